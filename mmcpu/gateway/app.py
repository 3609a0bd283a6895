"""The gateway: one OpenAI-compatible base URL in front of the vLLM engines of MMCPU_ENGINES.

``create_app(settings)`` builds the FastAPI app; ``main()`` serves it with uvicorn (container role ``gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
        # Clients per app: one per engine for requests, one for the probes (Upstreams).
        async with Upstreams(settings, metrics) as upstreams:
            app.state.upstreams = upstreams
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
    app.add_middleware(
        GatewayMiddleware, limit_bytes=limit_bytes(settings), body_timeout_s=settings.body_timeout_s, metrics=metrics
    )
    return app


LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def check_exposure(settings: Settings) -> None:
    """Fail closed: no listening beyond loopback without a client key, unless MMCPU_ALLOW_UNAUTHENTICATED says so."""
    key = settings.api_key.get_secret_value() if settings.api_key is not None else ""
    if not key and settings.host not in LOOPBACK and not settings.allow_unauthenticated:
        raise SystemExit(
            f"mmcpu gateway: refusing to listen on {settings.host} without MMCPU_API_KEY: anyone who reaches it "
            "could use the engines. Set MMCPU_API_KEY, listen on 127.0.0.1 (MMCPU_HOST), or set "
            "MMCPU_ALLOW_UNAUTHENTICATED=true where only trusted clients reach this address."
        )


def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_exposure(settings)
    # access_log off: GatewayMiddleware already writes the one line per request. On SIGTERM uvicorn closes the
    # listening socket (new connections are refused) and gives in-flight requests drain_s to finish.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.gateway_port,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=math.ceil(settings.drain_s),  # uvicorn takes whole seconds
    )


if __name__ == "__main__":
    main()
