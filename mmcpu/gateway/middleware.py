"""One pure-ASGI middleware (pure, so streamed responses are never buffered): enforces the body size limit while
the body streams in, records Prometheus metrics and writes one log line per request."""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmcpu.gateway.errors import BodyTimeout, BodyTooLarge
from mmcpu.gateway.metrics import Metrics

log = logging.getLogger("mmcpu.gateway")


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, *, limit_bytes: int, body_timeout_s: float, metrics: Metrics) -> None:
        self.app = app
        self.limit = limit_bytes
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None
        received = 0
        failure = ""
        body_done = False

        async def limited_receive() -> Message:
            # Content-Length is checked before any engine is called (dependencies.check_content_length);
            # this catches chunked uploads and bodies longer than they declared. The whole body must arrive by
            # the deadline: a client trickling bytes (slow-loris) holds no engine place for longer.
            nonlocal received, body_done
            if body_done:
                return await receive()  # only the disconnect is left to come
            if status is not None:  # the answer already started (an engine that refused an upload early)
                message = await receive()
            else:
                try:
                    async with asyncio.timeout(start + self.body_timeout_s - time.perf_counter()):
                        message = await receive()
                except TimeoutError:
                    raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception as exc:
            failure = f" aborted={type(exc).__name__}"
            raise
        finally:
            route = scope.get("route")
            label = getattr(route, "path", "unmatched")
            elapsed = time.perf_counter() - start
            code = str(status) if status is not None else "none"
            self.metrics.requests.labels(label, scope["method"], code).inc()
            self.metrics.latency.labels(label).observe(elapsed)
            client = scope.get("client") or ("-", 0)
            engine = scope.get("state", {}).get("engine", "-")
            log.info(
                "%s %s %s %s %.1fms in=%dB engine=%s%s",
                client[0],
                scope["method"],
                scope["path"],
                code,
                elapsed * 1000,
                received,
                engine,
                failure,
            )
