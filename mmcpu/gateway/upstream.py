"""The engines behind the gateway: which engine serves which model, engine up/down state, and the streaming proxy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mmcpu.config import Settings
from mmcpu.gateway.errors import ClientGone, OpenAIError, engine_unavailable
from mmcpu.gateway.metrics import Metrics
from mmcpu.health import (  # progress means the same here as to the health check
    StallDetector,
    engine_headers,
    token_count,
)

log = logging.getLogger("mmcpu.gateway")

# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones uvicorn writes itself are not copied from engine responses.
_DROP_RESPONSE_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "server",
}

# How often an engine that is down is probed again in the background: routing to it resumes within this time of
# its coming back, and no request has to wait for the probe.
RECHECK_S = 1.0


@dataclass(eq=False)
class Engine:
    name: str
    url: str
    up: bool | None = None  # None: not heard from yet
    error: str | None = None  # why it is down
    # Last model list it returned, kept while it is down: a request for one of its models is then answered
    # 503 (engine down), not 404 (unknown model).
    models: list[dict[str, Any]] = field(default_factory=list)
    listed_at: float = float("-inf")
    # Hang detection: the request path reports waiting and progress to it, Upstreams.check_stalls asks it.
    stall: StallDetector = field(default_factory=lambda: StallDetector(0))
    # Requests only (probes have a client of their own): a pool sized to what the engine runs at once, so slow
    # clients of one engine never take connections another engine's requests or the probes need.
    client: httpx.AsyncClient | None = None
    admission: Admission | None = None

    def serves(self, model: str) -> bool:
        return any(m.get("id") == model for m in self.models)


class Admission:
    """One engine's places: ``concurrency`` requests in flight, ``queue`` more waiting at most ``timeout_s`` for
    one. Beyond that a request is refused at once (429), so a burst costs the gateway no memory or time and the
    client knows to come back."""

    def __init__(self, concurrency: int, queue: int, timeout_s: float, retry_after_s: int) -> None:
        self.concurrency, self.limit, self.timeout_s = concurrency, concurrency + queue, timeout_s
        self.retry_after = str(retry_after_s)
        self.slots = asyncio.Semaphore(concurrency)
        self.held = 0  # in flight + queued

    async def enter(self, engine: str) -> Callable[[], None]:
        """A place at the engine (waiting for it in the queue); returns its release, safe to call twice."""
        if self.held >= self.limit:
            raise OpenAIError(
                429,
                f"The {engine} engine is at its limit of {self.limit} requests in flight and queued "
                "(MMCPU_ENGINE_CONCURRENCY + MMCPU_ENGINE_QUEUE): retry later",
                type="server_error",
                code="engine_overloaded",
                headers={"Retry-After": self.retry_after},
            )
        self.held += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.slots.acquire()
        except TimeoutError:
            self.held -= 1
            raise OpenAIError(
                503,
                f"The {engine} engine stayed busy: no place within {self.timeout_s:g} s (MMCPU_QUEUE_TIMEOUT_S)",
                type="server_error",
                code="engine_busy",
                headers={"Retry-After": self.retry_after},
            ) from None
        except BaseException:
            self.held -= 1
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= 1
                self.slots.release()

        return release


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Upstreams:
    """One per app: the engines (in MMCPU_ENGINES order) with their own request clients and admission limits, the
    probes' client, and the engines' model lists. ``async with Upstreams(...)`` closes the clients at the end."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.metrics = metrics
        self.probe_timeout = httpx.Timeout(settings.health_timeout_s, connect=settings.connect_timeout_s)
        self.models_ttl = settings.models_ttl_s
        self.stall_s = settings.stall_s
        # MMCPU_ENGINE_API_KEY on every engine call (vLLM guards /v1/*; /health and /metrics are open): the probes'
        # /v1/models as much as the requests. A client's own Authorization is never passed on (forward copies
        # only the headers it names), so the internal key is the only one an engine sees.
        auth = engine_headers(settings)
        # trust_env=False: engine URLs are internal; an HTTP(S)_PROXY meant for the outside must not catch them.
        # Probes: a few connections of their own, so /health answers while every request place is taken.
        self.client = httpx.AsyncClient(
            timeout=self.probe_timeout,
            trust_env=False,
            headers=auth,
            limits=httpx.Limits(max_connections=4 * len(settings.engines) + 4),
        )
        concurrency = settings.engine_concurrency
        # Connecting gets a short timeout so a request for an engine that is down is answered 503 quickly; a running
        # request may take request_timeout_s between bytes. Admission holds at most `concurrency` requests per
        # engine, so the pool never makes one wait (its timeout is a backstop).
        timeout = httpx.Timeout(
            settings.request_timeout_s, connect=settings.connect_timeout_s, pool=settings.queue_timeout_s
        )
        self.engines = {
            name: Engine(
                name,
                url,
                stall=StallDetector(settings.stall_s),
                client=httpx.AsyncClient(
                    timeout=timeout,
                    trust_env=False,
                    headers=auth,
                    limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
                ),
                admission=Admission(
                    concurrency, settings.engine_queue, settings.queue_timeout_s, settings.retry_after_s
                ),
            )
            for name, url in settings.engines.items()
        }

    async def __aenter__(self) -> Upstreams:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(self.client.aclose(), *(e.client.aclose() for e in self.engines.values() if e.client))

    # --- state --------------------------------------------------------------------------------------
    def _mark(self, engine: Engine, up: bool, error: str | None = None) -> None:
        if engine.up is not False and not up:
            log.warning("engine %s is down: %s", engine.name, error)
        elif engine.up is False and up:
            log.info("engine %s is up again", engine.name)
        engine.up, engine.error = up, None if up else error
        if up:
            engine.stall.clear()
        self.metrics.engine_up.labels(engine.name).set(1 if up else 0)

    async def probe(self, engine: Engine) -> None:
        """Ask the engine's /health; one that (re)turns healthy also lists its models again."""
        was_up = engine.up
        try:
            r = await self.client.get(f"{engine.url}/health", timeout=self.probe_timeout)
        except httpx.HTTPError as exc:
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                engine.stall.forget()  # gone: what comes back on its address is a new process
            self._mark(engine, False, _reason(exc))
            return
        if r.status_code != 200:
            self._mark(engine, False, f"/health answered {r.status_code}")
        elif engine.stall.is_hung:
            # vLLM's /health answers while its EngineCore hangs: only moved counters bring a hung engine back.
            if engine.stall.recovered(await self.read_tokens(engine)):
                engine.stall.forget()
                await self.list_models(engine)
        elif was_up is not True:
            await self.list_models(engine)  # marks it
        else:
            self._mark(engine, True)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.engines.values()))

    async def watch(self) -> None:
        """Background task of the app: re-probe the engines that are down until they come back, and mark the
        ones whose requests stall down (check_stalls)."""
        while True:
            await asyncio.sleep(RECHECK_S)
            down = [e for e in self.engines.values() if e.up is False]
            with contextlib.suppress(Exception):  # a failed probe marks its engine; the loop must live on
                await asyncio.gather(*(self.probe(e) for e in down), self.check_stalls())

    async def read_tokens(self, engine: Engine) -> float | None:
        try:
            r = await self.client.get(f"{engine.url}/metrics", timeout=self.probe_timeout)
            r.raise_for_status()
            return token_count(r.text)
        except (httpx.HTTPError, ValueError, IndexError, TypeError):
            return None

    async def check_stalls(self) -> None:
        """An engine whose StallDetector says its waiting requests stalled is marked down, its waiting requests
        answered 503 engine_unavailable at once, and new ones too, until its counters move or it goes away (its
        launcher's watchdog restarts it)."""
        if not self.stall_s:
            return
        busy = [e for e in self.engines.values() if e.up and e.stall.inflight]
        due = [e for e in busy if e.stall.counters_due()]
        for engine, tokens in zip(due, await asyncio.gather(*(self.read_tokens(e) for e in due)), strict=False):
            engine.stall.counters(tokens)
        for engine in busy:
            if engine.up and (quiet := engine.stall.stalled()) is not None:
                self._mark(
                    engine,
                    False,
                    f"hung: {engine.stall.inflight} request(s) waiting, no progress for {quiet:.0f}s (MMCPU_STALL_S)",
                )
                self.metrics.upstream_errors.labels(engine.name, "stall").inc()
                engine.stall.hang()

    # --- models -------------------------------------------------------------------------------------
    async def list_models(self, engine: Engine) -> None:
        try:
            r = await self.client.get(f"{engine.url}/v1/models", timeout=self.probe_timeout)
            r.raise_for_status()
            data = r.json()["data"]
            if not isinstance(data, list) or not all(
                isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
            ):
                raise ValueError("/v1/models 'data' is not a list of models with ids")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._mark(engine, False, _reason(exc))
            return
        engine.models, engine.listed_at = data, time.monotonic()
        self._mark(engine, True)

    async def refresh(self) -> None:
        """Re-read the lists of the engines not known to be down (watch() brings those back): no caller waits
        on an engine that does not answer."""
        await asyncio.gather(*(self.list_models(e) for e in self.engines.values() if e.up is not False))

    def models(self) -> list[dict[str, Any]]:
        """The models of the engines that are up; the first engine wins on a duplicate id."""
        merged: dict[str, dict[str, Any]] = {}
        for engine in self.engines.values():
            if engine.up:
                for model in engine.models:
                    merged.setdefault(model["id"], model)
        return list(merged.values())

    def down(self) -> dict[str, str]:
        return {e.name: e.error or "not reached yet" for e in self.engines.values() if not e.up}

    def down_summary(self) -> str:
        return "; ".join(f"{name} ({why})" for name, why in self.down().items())

    def _lookup(self, model: str) -> Engine | None:
        # The first engine that is up and lists it; else the first that listed it last (down: answered 503).
        listing = [e for e in self.engines.values() if e.serves(model)]
        return next((e for e in listing if e.up), listing[0] if listing else None)

    async def engine_for_model(self, model: str) -> Engine:
        """The engine serving ``model``. Its list is trusted for models_ttl_s; a miss re-reads every list at once."""
        engine = self._lookup(model)
        if engine is None or (engine.up and time.monotonic() - engine.listed_at >= self.models_ttl):
            await self.refresh()
            engine = self._lookup(model)
        if engine is not None:
            if not engine.up:  # known from its last list: answered at once, no connect attempt
                raise engine_unavailable(engine.name, engine.error or "down")
            return engine
        if self.down():
            raise OpenAIError(
                503,
                f"The model '{model}' is not served by any engine that is up; unavailable: {self.down_summary()}",
                type="server_error",
                param="model",
                code="engine_unavailable",
            )
        raise OpenAIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")

    def max_model_len(self, engine: Engine, model: str) -> int | None:
        """The model length the engine's /v1/models gives for ``model`` (vLLM's ``max_model_len``), if any."""
        for entry in engine.models:
            if entry.get("id") == model:
                value = entry.get("max_model_len")
                return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
        return None

    # --- proxy --------------------------------------------------------------------------------------
    async def forward(
        self,
        engine: Engine,
        request: Request,
        content: bytes | AsyncIterable[bytes],
        default_content_type: str = "application/octet-stream",
    ) -> StreamingResponse:
        """Send the request to the engine and stream its answer back as it arrives (status and body as is). It
        needs a place at the engine first (:class:`Admission`: 429 when full, 503 when the wait is too long); the
        place is held until the answer's last byte or the client is gone."""
        request.state.engine = engine.name
        assert engine.admission is not None and engine.client is not None
        release = await engine.admission.enter(engine.name)
        try:
            return await self._forward(engine, request, content, default_content_type, release)
        except BaseException:
            release()
            raise

    async def _forward(
        self,
        engine: Engine,
        request: Request,
        content: bytes | AsyncIterable[bytes],
        default_content_type: str,
        release: Callable[[], None],
    ) -> StreamingResponse:
        assert engine.client is not None
        headers = {
            "content-type": request.headers.get("content-type") or default_content_type,
            "accept": request.headers.get("accept", "*/*"),
            # Bytes go back to the client untouched, so ask the engine not to compress them.
            "accept-encoding": "identity",
        }
        # The stall clock runs only once the whole body is with the engine: a client's slow upload is not the
        # engine's stall (and the body deadline, MMCPU_BODY_TIMEOUT_S, bounds the upload).
        sent = asyncio.Event()
        if isinstance(content, bytes):
            sent.set()
        else:
            content = _until_sent(content, sent)
            if "content-length" in request.headers:
                headers["content-length"] = request.headers["content-length"]  # else httpx sends it chunked
        upstream = engine.client.build_request(
            request.method,
            engine.url + request.url.path,
            params=request.query_params,
            headers=headers,
            content=content,
        )
        response = await self._send_unless_hung(engine, upstream, sent, request)
        engine.stall.progressed()
        return self._respond(engine, response, release)

    async def _send_unless_hung(
        self, engine: Engine, upstream: httpx.Request, sent: asyncio.Event, request: Request
    ) -> httpx.Response:
        """client.send, given up as soon as the engine is marked hung (503) or the client goes away (the engine's
        connection is closed, so vLLM aborts the request: a non-streamed answer is not computed for nobody)."""
        assert engine.client is not None
        send = asyncio.ensure_future(engine.client.send(upstream, stream=True))
        watch = asyncio.ensure_future(self._watch(engine, sent, request))
        try:
            await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not send.done():
                send.cancel()
                with contextlib.suppress(BaseException):
                    await send
            with contextlib.suppress(BaseException):
                await watch
        if send.cancelled():
            if not watch.cancelled() and watch.exception() is None and watch.result() == "gone":
                raise ClientGone()
            raise engine_unavailable(engine.name, engine.error or "hung")
        try:
            response = send.result()
        except OpenAIError:  # the body's limits (413, 408) while it streamed to the engine
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._upstream_error(engine, "connect", exc)
            # One failed connection does not mark the engine down: behind one URL (a Kubernetes Service) other
            # replicas may serve. A probe decides (it fails at once when the one process is gone).
            await self.probe(engine)
            raise engine_unavailable(engine.name, _reason(exc)) from exc
        except httpx.TimeoutException as exc:
            self._upstream_error(engine, "timeout", exc)
            raise OpenAIError(
                504,
                f"The {engine.name} engine did not answer in time ({_reason(exc)}); see MMCPU_REQUEST_TIMEOUT_S",
                type="server_error",
                code="engine_timeout",
            ) from exc
        except httpx.TransportError as exc:
            self._upstream_error(engine, "transport", exc)
            raise OpenAIError(
                502, f"The {engine.name} engine failed: {_reason(exc)}", type="server_error", code="engine_error"
            ) from exc
        return response

    async def _watch(self, engine: Engine, sent: asyncio.Event, request: Request) -> str:
        """Ends with "hung" when the engine is marked hung, "gone" when the client disconnects; counts the wait for
        the engine's answer as stall time only once the body is sent."""
        hung = asyncio.ensure_future(engine.stall.hung.wait())
        body_sent = asyncio.ensure_future(sent.wait())
        try:
            await asyncio.wait({hung, body_sent}, return_when=asyncio.FIRST_COMPLETED)
            if hung.done():
                return "hung"
            with engine.stall.waiting():  # for the response's headers (a hung engine never sends them)
                # The body is read whole, so the next message the server has for this request is its disconnect.
                gone = asyncio.ensure_future(request.receive())
                try:
                    await asyncio.wait({hung, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                if hung.done():
                    return "hung"
                if (
                    gone.done()
                    and not gone.cancelled()
                    and gone.exception() is None
                    and gone.result().get("type") == "http.disconnect"
                ):
                    return "gone"
                await hung  # any other message: only a hang ends the wait now
                return "hung"
        finally:
            hung.cancel()
            body_sent.cancel()

    def _respond(self, engine: Engine, response: httpx.Response, release: Callable[[], None]) -> StreamingResponse:
        self._mark(engine, True)
        if response.status_code >= 500:
            self.metrics.upstream_errors.labels(engine.name, "http_5xx").inc()
        passed = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}

        return _EngineResponse(
            self._relay(engine, response, release),
            status_code=response.status_code,
            headers=passed,
            upstream=response,
            release=release,
        )

    async def _relay(
        self, engine: Engine, response: httpx.Response, release: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        # aiter_raw yields each chunk as it comes off the socket: SSE events are not held back.
        try:
            async for chunk in response.aiter_raw():
                engine.stall.progressed()
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are already sent: the only honest signal left is to abort the connection.
            self._upstream_error(engine, "broken_stream", exc)
            raise
        finally:
            release()
            await response.aclose()

    def _upstream_error(self, engine: Engine, kind: str, exc: BaseException) -> None:
        self.metrics.upstream_errors.labels(engine.name, kind).inc()
        log.warning("engine %s %s error: %s", engine.name, kind, _reason(exc))


async def _until_sent(content: AsyncIterable[bytes], sent: asyncio.Event) -> AsyncIterator[bytes]:
    async for chunk in content:
        yield chunk
    sent.set()


class _EngineResponse(StreamingResponse):
    """The engine's answer streamed on; however it ends (done, client gone, cancelled, never iterated), the engine
    place is given back and the engine connection closed."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        status_code: int,
        headers: dict[str, str],
        upstream: httpx.Response,
        release: Callable[[], None],
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self.upstream, self.release = upstream, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
            await self.upstream.aclose()
