"""The engines behind the gateway: which engine serves which model, health probes, and the streaming proxy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from mmcpu.config import Settings
from mmcpu.gateway.errors import BodyTooLarge, OpenAIError, engine_unavailable
from mmcpu.gateway.metrics import Metrics

log = logging.getLogger("mmcpu.gateway")

# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones uvicorn writes itself are not copied from engine responses.
_DROP_RESPONSE_HEADERS = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "date", "server",
}


@dataclass(frozen=True)
class Engine:
    name: str
    url: str


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Upstreams:
    """One per app: the shared httpx client, the engines and the model → engine table."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient, metrics: Metrics) -> None:
        self.client = client
        self.metrics = metrics
        self.health_timeout = settings.health_timeout_s
        self.models_ttl = settings.models_ttl_s
        self.engines = {
            "audio": Engine("audio", settings.audio_url.rstrip("/")),
            "vision": Engine("vision", settings.vision_url.rstrip("/")),
        }
        # Last model list each engine returned. Kept when a later listing fails, so that a request for the
        # model of an engine that went down is answered 503 (engine down), not 404 (unknown model).
        self._listed: dict[str, list[dict[str, Any]]] = {}
        self._listed_at = float("-inf")

    # --- health -------------------------------------------------------------------------------------
    def _mark(self, engine: Engine, up: bool) -> None:
        self.metrics.engine_up.labels(engine.name).set(1 if up else 0)

    async def probe(self, engine: Engine) -> str | None:
        """None when the engine's /health answers 200, else why not."""
        try:
            r = await self.client.get(f"{engine.url}/health", timeout=self.health_timeout)
        except httpx.HTTPError as exc:
            reason = _reason(exc)
        else:
            reason = None if r.status_code == 200 else f"/health answered {r.status_code}"
        self._mark(engine, reason is None)
        return reason

    async def probe_all(self) -> dict[str, str | None]:
        reasons = await asyncio.gather(*(self.probe(e) for e in self.engines.values()))
        return dict(zip(self.engines, reasons, strict=True))

    # --- models -------------------------------------------------------------------------------------
    async def _list(self, engine: Engine) -> list[dict[str, Any]]:
        r = await self.client.get(f"{engine.url}/v1/models", timeout=self.health_timeout)
        r.raise_for_status()
        data = r.json()["data"]
        if not isinstance(data, list):
            raise ValueError("/v1/models 'data' is not a list")
        return data

    async def refresh(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Ask every engine for its models. Returns (models of the engines that answered, {down engine: why})."""
        results = await asyncio.gather(*(self._list(e) for e in self.engines.values()), return_exceptions=True)
        merged: dict[str, dict[str, Any]] = {}
        down: dict[str, str] = {}
        for engine, result in zip(self.engines.values(), results, strict=True):
            if isinstance(result, BaseException):
                down[engine.name] = _reason(result)
                self._mark(engine, False)
                continue
            self._mark(engine, True)
            self._listed[engine.name] = result
            for model in result:
                merged.setdefault(model["id"], model)  # the first engine wins on a duplicate id
        self._listed_at = time.monotonic()
        return list(merged.values()), down

    def _lookup(self, model: str) -> Engine | None:
        for name, models in self._listed.items():
            if any(m.get("id") == model for m in models):
                return self.engines[name]
        return None

    async def engine_for_model(self, model: str) -> Engine:
        """The engine serving ``model``; the table is cached for models_ttl_s and re-read on a miss."""
        engine = self._lookup(model)
        if engine is not None and time.monotonic() - self._listed_at < self.models_ttl:
            return engine
        _, down = await self.refresh()
        engine = self._lookup(model)
        if engine is not None:
            if engine.name in down:
                raise engine_unavailable(engine.name, down[engine.name])
            return engine
        if down:
            which = "; ".join(f"{name} ({why})" for name, why in down.items())
            raise OpenAIError(
                503, f"The model '{model}' is not served by any engine that is up; unavailable: {which}",
                type="server_error", param="model", code="engine_unavailable",
            )
        raise OpenAIError(
            404, f"The model '{model}' does not exist.", param="model", code="model_not_found",
        )

    # --- proxy --------------------------------------------------------------------------------------
    async def forward(
        self,
        engine: Engine,
        request: Request,
        content: bytes | AsyncIterable[bytes],
        default_content_type: str = "application/octet-stream",
    ) -> StreamingResponse:
        """Send the request to the engine and stream its answer back as it arrives (status and body as is)."""
        request.state.engine = engine.name
        headers = {
            "content-type": request.headers.get("content-type") or default_content_type,
            "accept": request.headers.get("accept", "*/*"),
            # Bytes go back to the client untouched, so ask the engine not to compress them.
            "accept-encoding": "identity",
        }
        if not isinstance(content, bytes) and "content-length" in request.headers:
            headers["content-length"] = request.headers["content-length"]  # else httpx sends it chunked
        upstream = self.client.build_request(
            request.method, engine.url + request.url.path, params=request.query_params, headers=headers,
            content=content,
        )
        try:
            response = await self.client.send(upstream, stream=True)
        except BodyTooLarge:
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._upstream_error(engine, "connect", exc)
            self._mark(engine, False)
            raise engine_unavailable(engine.name, _reason(exc)) from exc
        except httpx.TimeoutException as exc:
            self._upstream_error(engine, "timeout", exc)
            raise OpenAIError(
                504, f"The {engine.name} engine did not answer in time ({_reason(exc)}); see MMCPU_REQUEST_TIMEOUT_S",
                type="server_error", code="engine_timeout",
            ) from exc
        except httpx.TransportError as exc:
            self._upstream_error(engine, "transport", exc)
            raise OpenAIError(
                502, f"The {engine.name} engine failed: {_reason(exc)}", type="server_error", code="engine_error"
            ) from exc
        self._mark(engine, True)
        if response.status_code >= 500:
            self.metrics.upstream_errors.labels(engine.name, "http_5xx").inc()
        passed = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
        return StreamingResponse(
            self._relay(engine, response), status_code=response.status_code, headers=passed,
            background=BackgroundTask(response.aclose),
        )

    async def _relay(self, engine: Engine, response: httpx.Response) -> AsyncIterator[bytes]:
        # aiter_raw yields each chunk as it comes off the socket: SSE events are not held back.
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are already sent: the only honest signal left is to abort the connection.
            self._upstream_error(engine, "broken_stream", exc)
            raise
        finally:
            await response.aclose()

    def _upstream_error(self, engine: Engine, kind: str, exc: BaseException) -> None:
        self.metrics.upstream_errors.labels(engine.name, kind).inc()
        log.warning("engine %s %s error: %s", engine.name, kind, _reason(exc))
