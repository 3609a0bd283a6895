"""Realtime transcription on OpenAI's wire: ``/v1/realtime`` (WebSocket) and the browser page ``/realtime``.

The WebSocket ends here, in the gateway; each turn goes to the engine serving the session's model as an ordinary
transcription request (mmcpu.realtime). Keys are the HTTP API's: ``Authorization: Bearer KEY``, or for a browser
(which cannot set headers on a WebSocket) the subprotocols ``realtime`` and ``openai-insecure-api-key.KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from importlib import resources

from fastapi import APIRouter, FastAPI, WebSocket
from fastapi.responses import HTMLResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from mmcpu import vad
from mmcpu.gateway.errors import OpenAIError
from mmcpu.realtime import protocol as p
from mmcpu.realtime.session import Closed, Hub, Session

log = logging.getLogger("mmcpu.realtime")
router = APIRouter(tags=["realtime"])

KEY_PROTOCOL = "openai-insecure-api-key."
BETA_PROTOCOL = "openai-beta.realtime-v1"
PAGE_HEADERS = {
    # The page's own script and the WebSocket back to this origin; nothing from elsewhere.
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline' blob:; style-src 'unsafe-inline'; "
    "connect-src 'self'; worker-src blob:",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def hub(app: FastAPI) -> Hub:
    """The app's realtime sessions (made on first use: its gauges join the app's /metrics then)."""
    if getattr(app.state, "realtime", None) is None:
        app.state.realtime = Hub(app.state.settings, app.state.metrics.registry)
    return app.state.realtime


@router.get("/realtime", include_in_schema=False)
async def page() -> HTMLResponse:
    html = resources.files("mmcpu.realtime").joinpath("static/realtime.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers=PAGE_HEADERS)


def _key_ok(websocket: WebSocket, offered: list[str]) -> bool:
    key = websocket.app.state.settings.api_key
    expected = key.get_secret_value() if key is not None else ""
    if not expected:
        return True
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = next((s[len(KEY_PROTOCOL) :] for s in offered if s.startswith(KEY_PROTOCOL)), "")
    return secrets.compare_digest(token.strip().encode(), expected.encode())


async def _deny(websocket: WebSocket, error: OpenAIError) -> None:
    """Refuse the handshake with an HTTP answer in OpenAI's schema (a server without that extension: close 1008)."""
    try:
        await websocket.send_denial_response(error.response())
    except RuntimeError:
        await websocket.close(1008, error.message[:120])


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    offered = [s.strip() for s in websocket.headers.get("sec-websocket-protocol", "").split(",") if s.strip()]
    if not _key_ok(websocket, offered):
        await _deny(
            websocket,
            OpenAIError(
                401,
                "Missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "or the subprotocol 'openai-insecure-api-key.<key>'.",
                code="invalid_api_key",
            ),
        )
        return
    intent = websocket.query_params.get("intent")
    if intent not in (None, "transcription"):
        await _deny(
            websocket,
            OpenAIError(400, f"intent {intent!r} is not served here: only intent=transcription", param="intent"),
        )
        return
    # A browser drops the connection unless one of its subprotocols is echoed; the key is never echoed.
    subprotocol = next((s for s in ("realtime", BETA_PROTOCOL) if s in offered), None)
    await websocket.accept(subprotocol=subprotocol)
    sessions = hub(websocket.app)
    if not sessions.open():
        limit = websocket.app.state.settings.realtime_max_sessions
        await websocket.send_text(
            json.dumps(
                p.error_event(
                    f"The gateway holds its limit of {limit} realtime sessions (MMCPU_REALTIME_MAX_SESSIONS): "
                    "try again later",
                    type="server_error",
                    code="session_limit_reached",
                )
            )
        )
        await websocket.close(1013)
        return
    beta = "realtime=v1" in websocket.headers.get("openai-beta", "") or BETA_PROTOCOL in offered

    async def receive() -> str | bytes | None:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return None
        return message["text"] if message.get("text") is not None else message.get("bytes") or b""

    async def send(text: str) -> None:
        try:
            await websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError):  # the client went away (RuntimeError: after its close)
            raise Closed("the client is gone") from None

    try:
        session = Session(
            sessions, websocket.app.state.upstreams, receive, send, beta=beta, model=websocket.query_params.get("model")
        )
    except vad.VadUnavailable as exc:  # a deployment problem: said to the client, and logged
        sessions.close(None)
        log.error("realtime: %s", exc)
        await websocket.send_text(json.dumps(p.error_event(str(exc), type="server_error", code="vad_unavailable")))
        await websocket.close(1011)
        return
    except BaseException:
        sessions.close(None)
        raise
    try:
        await session.run()
    finally:
        if (
            websocket.application_state == WebSocketState.CONNECTED
            and websocket.client_state == WebSocketState.CONNECTED
        ):
            with contextlib.suppress(Exception):  # bounded: a client that reads nothing never takes the close
                async with asyncio.timeout(websocket.app.state.settings.realtime_send_timeout_s):
                    await websocket.close(1000)
