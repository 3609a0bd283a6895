"""The gateway: one OpenAI-compatible base URL in front of the audio and the vision vLLM engines.

``create_app(settings)`` builds the FastAPI app; ``main()`` serves it with uvicorn (container role ``gateway``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI

from mmcpu.config import Settings, get_settings
from mmcpu.gateway.dependencies import API_DEPENDENCIES, limit_bytes
from mmcpu.gateway.errors import install_error_handlers
from mmcpu.gateway.metrics import Metrics
from mmcpu.gateway.middleware import GatewayMiddleware
from mmcpu.gateway.routes import audio, chat, models, ops
from mmcpu.gateway.upstream import Upstreams


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One client (and connection pool) per app. Connecting gets the short probe timeout so a down
        # engine is reported quickly; a running request may take request_timeout_s between bytes.
        timeout = httpx.Timeout(
            settings.request_timeout_s, connect=min(settings.health_timeout_s, settings.request_timeout_s)
        )
        # trust_env=False: engine URLs are internal; an HTTP(S)_PROXY meant for the outside must not catch them.
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            app.state.upstreams = Upstreams(settings, client, metrics)
            yield

    app = FastAPI(title="mmcpu gateway", summary="OpenAI-compatible front of the vLLM CPU engines", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(ops.router)
    for router in (audio.router, chat.router, models.router):
        app.include_router(router, dependencies=API_DEPENDENCIES)
    app.add_middleware(GatewayMiddleware, limit_bytes=limit_bytes(settings), metrics=metrics)
    return app


def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # access_log off: GatewayMiddleware already writes the one line per request.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, access_log=False, log_config=None
    )


if __name__ == "__main__":
    main()
