"""The OpenAI inference routes, all routed alike: by the request's ``model`` to the engine whose /v1/models lists it.

JSON bodies (chat) are read whole, as the engine needs them whole anyway. Multipart uploads (audio) are read only
up to the end of their ``model`` field (the openai client sends it before the file); those chunks are then sent on
ahead of the rest of the stream, so the upload is neither buffered whole nor parsed or re-encoded.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.responses import StreamingResponse

from mmcpu.gateway.dependencies import UpstreamsDep
from mmcpu.gateway.errors import OpenAIError

router = APIRouter(tags=["inference"])


def _bad_model(problem: str) -> OpenAIError:
    # Several engines sit behind this URL, so there is no default model to fall back on.
    return OpenAIError(400, f"'model' {problem}: a model id from /v1/models.", param="model")


class _ModelField:
    """Fed multipart chunks, collects the value of the first part named ``model``; ``done`` once it is complete."""

    def __init__(self, boundary: bytes) -> None:
        self.value = bytearray()
        self.done = False
        self.is_file = False
        self._header = self._value = self._disposition = b""
        self._current = False
        self.parser = MultipartParser(boundary, {
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_data,
            "on_part_end": self._on_part_end,
        })

    # Header names and values arrive in pieces wherever a read ends: collect until the header ends.
    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _on_header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header = self._value = b""

    def _on_headers_finished(self) -> None:
        # One write() may hold several parts: only the first model part counts, later parts change nothing.
        _, params = parse_options_header(self._disposition)
        self._current = not self.done and params.get(b"name") == b"model"
        if self._current:
            self.is_file = b"filename" in params
        self._disposition = b""

    def _on_data(self, data: bytes, start: int, end: int) -> None:
        if self._current:
            self.value += data[start:end]

    def _on_part_end(self) -> None:
        self.done = self.done or self._current
        self._current = False


async def _multipart_model(request: Request, content_type: str) -> tuple[str, AsyncIterator[bytes]]:
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise OpenAIError(400, "multipart/form-data without a boundary")
    field = _ModelField(boundary)
    stream = request.stream()  # the size limit applies while this reads (GatewayMiddleware)
    head: list[bytes] = []
    async for chunk in stream:
        head.append(chunk)
        try:
            field.parser.write(chunk)
        except MultipartParseError as exc:
            raise OpenAIError(400, f"Malformed multipart body: {exc}") from exc
        if field.done:
            break
    if not field.done:
        raise _bad_model("is required")
    if field.is_file:
        raise _bad_model("must be a string, not a file")
    try:
        model = field.value.decode()
    except UnicodeDecodeError as exc:
        raise _bad_model("must be UTF-8 text") from exc

    async def body() -> AsyncIterator[bytes]:
        for chunk in head:
            yield chunk
        async for chunk in stream:  # the same generator, where the search stopped
            yield chunk

    return model, body()


async def _json_model(request: Request) -> tuple[object, bytes]:
    raw = await request.body()
    try:
        payload = json.loads(raw)
    except ValueError as exc:
        raise OpenAIError(400, f"The request body is not valid JSON: {exc}") from exc
    return (payload.get("model") if isinstance(payload, dict) else None), raw


@router.post("/v1/audio/transcriptions")
@router.post("/v1/audio/translations")
@router.post("/v1/chat/completions")
async def proxy(request: Request, upstreams: UpstreamsDep) -> StreamingResponse:
    content_type = request.headers.get("content-type", "")
    if content_type.lower().startswith("multipart/form-data"):
        model, content = await _multipart_model(request, content_type)
    else:
        model, content = await _json_model(request)
    if model is None or model == "":
        raise _bad_model("is required")
    if not isinstance(model, str):
        raise _bad_model("must be a string")
    engine = await upstreams.engine_for_model(model)
    # A body that parsed as JSON is sent as such even if the client did not say so (vLLM's FastAPI insists on it).
    return await upstreams.forward(engine, request, content, default_content_type="application/json")
