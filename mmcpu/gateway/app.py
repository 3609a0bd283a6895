"""The gateway: one OpenAI-compatible base URL in front of the vLLM engines of MMCPU_ENGINES.

``create_app(settings)`` builds the FastAPI app; ``main()`` serves it with uvicorn (container role ``gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from mmcpu.gateway.routes import models, ops, proxy, realtime
from mmcpu.gateway.upstream import Upstreams


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One client (and connection pool) per app. Connecting gets a short timeout so a request for an engine
        # that is down is answered 503 quickly; a running request may take request_timeout_s between bytes.
        timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
        # trust_env=False: engine URLs are internal; an HTTP(S)_PROXY meant for the outside must not catch them.
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            upstreams = app.state.upstreams = Upstreams(settings, client, metrics)
            # Learn the model lists and re-probe down engines in the background: startup does not wait for them.
            tasks = [asyncio.create_task(upstreams.refresh()), asyncio.create_task(upstreams.watch())]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*tasks)

    app = FastAPI(title="mmcpu gateway", summary="OpenAI-compatible front of the vLLM CPU engines", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(ops.router)
    app.include_router(realtime.router)  # WebSocket: its own key check (Bearer or browser subprotocol)
    for router in (proxy.router, models.router):
        app.include_router(router, dependencies=API_DEPENDENCIES)
    app.add_middleware(GatewayMiddleware, limit_bytes=limit_bytes(settings), metrics=metrics)
    return app


def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # access_log off: GatewayMiddleware already writes the one line per request. On SIGTERM uvicorn closes the
    # listening socket (new connections are refused) and gives in-flight requests drain_s to finish.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.gateway_port, access_log=False, log_config=None,
        timeout_graceful_shutdown=settings.drain_s,
    )


if __name__ == "__main__":
    main()
