"""The one way a realtime session reaches an engine: an ordinary ``POST /v1/audio/transcriptions``.

Each committed turn, and each interim decode of the open one, is the request an HTTP client would send for the
same audio (a 16 kHz WAV) and the same ``model`` / ``language`` / ``prompt``, routed to the engine serving the model
as the gateway routes any request. So a turn's text is the HTTP API's text for that audio, and concurrent sessions
share the engine's batch (no engine per session). Cancelling the call (the session ended, or its interim decode is
no longer wanted) closes the connection, and vLLM aborts the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import numpy as np

from mmcpu.gateway.errors import OpenAIError
from mmcpu.gateway.upstream import Engine, Upstreams
from mmcpu.realtime.audio import ENGINE_RATE, wav_bytes

PATH = "/v1/audio/transcriptions"


@dataclass(frozen=True)
class Transcript:
    text: str
    seconds: float  # the usage the engine reports (duration), else the audio's length


class EngineError(Exception):
    """A failed transcription, in OpenAI's error fields (sent as ``...transcription.failed``)."""

    def __init__(
        self, message: str, *, type: str = "server_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.type, self.code, self.param = message, type, code, param

    def fields(self) -> dict[str, str | None]:
        return {"type": self.type, "code": self.code, "message": self.message, "param": self.param}


async def _engine(upstreams: Upstreams, model: str) -> Engine:
    try:
        return await upstreams.engine_for_model(model)
    except OpenAIError as exc:
        raise EngineError(exc.message, type=exc.type, code=exc.code, param=exc.param) from None


async def engine_for(upstreams: Upstreams, model: str) -> str:
    """The name of the engine serving ``model``; an unknown model or a down engine raise :class:`EngineError`."""
    return (await _engine(upstreams, model)).name


async def transcribe(
    upstreams: Upstreams, model: str, audio: np.ndarray, *, language: str | None = None, prompt: str | None = None
) -> Transcript:
    """``audio`` (int16, 16 kHz) transcribed by the engine serving ``model``."""
    engine = await _engine(upstreams, model)
    data = {"model": model, "response_format": "json"}
    if language:
        data["language"] = language
    if prompt:
        data["prompt"] = prompt
    files = {"file": ("audio.wav", wav_bytes(audio), "audio/wav")}
    assert engine.client is not None, "every configured engine has its pool"
    try:
        response = await engine.client.post(engine.url + PATH, data=data, files=files)  # the engine's own pool
    except httpx.HTTPError as exc:
        raise EngineError(
            f"The {engine.name} engine failed: {type(exc).__name__}: {exc}", code="engine_error"
        ) from None
    try:
        body = response.json()
    except json.JSONDecodeError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("text"), str):
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            raise EngineError(
                str(error.get("message")),
                type=str(error.get("type") or "server_error"),
                code=error.get("code") and str(error.get("code")),
                param=error.get("param"),
            )
        raise EngineError(
            f"The {engine.name} engine answered {response.status_code}: {response.text[:200]}", code="engine_error"
        )
    usage = body.get("usage")
    seconds = usage.get("seconds") if isinstance(usage, dict) else None
    if not isinstance(seconds, (int, float)):
        seconds = audio.size / ENGINE_RATE
    return Transcript(body["text"], float(seconds))
