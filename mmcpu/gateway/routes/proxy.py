"""The OpenAI inference routes, all routed alike: by the request's ``model`` to the engine whose /v1/models lists it.

JSON bodies (chat) are read whole, as the engine needs them whole anyway. Multipart uploads (audio) are read only
up to the end of their ``model`` field (the openai client sends it before the file); those chunks are then sent on
ahead of the rest of the stream, so the upload is neither buffered whole nor parsed or re-encoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import numpy as np
from fastapi import APIRouter, Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.responses import StreamingResponse

from mmcpu.config import Settings
from mmcpu.gateway.dependencies import SettingsDep, UpstreamsDep
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
        self.parser = MultipartParser(
            boundary,
            {
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_data,
                "on_part_end": self._on_part_end,
            },
        )

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


# Once escaped backslashes and quotes are gone, a string is '"[^"]*"': linear, no backtracking on any input.
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")
_OPEN = np.frombuffer(b"[{", np.uint8)


def check_json_shape(raw: bytes, max_depth: int, max_items: int) -> None:
    """400 for a body nested deeper than ``max_depth`` or holding more than ``max_items`` values, found from its
    bytes before it is parsed (in C: regular expressions and numpy), so parsing never meets a recursion limit or
    builds millions of objects. Each string counts as one value whatever its length (an image as base64)."""
    too_many = OpenAIError(
        400, f"The JSON body holds more than {max_items} values (MMCPU_MAX_JSON_ITEMS).", code="json_too_large"
    )
    # bytes.replace left to right pairs backslashes as a JSON string does; no per-match cost.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if unescaped.count(b'"') > 2 * max_items + 2:  # every string is a value or a key: bounds the matches below
        raise too_many
    structure = _STRING.sub(b'""', unescaped)
    opens = structure.count(b"[") + structure.count(b"{")
    closes = structure.count(b"]") + structure.count(b"}")
    if structure.count(b",") + opens > max_items or closes > max_items:
        raise too_many
    if opens > max_depth:  # fewer opening brackets cannot nest deeper: most bodies stop here
        brackets = np.frombuffer(_NOT_BRACKET.sub(b"", structure), np.uint8)
        steps = np.where(np.isin(brackets, _OPEN), 1, -1).astype(np.int32)
        if steps.size and int(np.cumsum(steps).max()) > max_depth:
            raise OpenAIError(
                400,
                f"The JSON body is nested deeper than {max_depth} levels (MMCPU_MAX_JSON_DEPTH).",
                code="json_too_deep",
            )


async def _json_model(request: Request, settings: Settings) -> tuple[object, bytes, object]:
    raw = await request.body()
    check_json_shape(raw, settings.max_json_depth, settings.max_json_items)
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(400, f"The request body is not valid JSON: {exc}") from exc
    return (payload.get("model") if isinstance(payload, dict) else None), raw, payload


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_work(payload: object, settings: Settings, model_len: int | None, model: str) -> None:
    """``n`` / ``best_of`` within MMCPU_MAX_N; ``max_tokens`` / ``max_completion_tokens`` within MMCPU_MAX_OUTPUT_TOKENS
    and the model length: 400 naming the parameter, before the engine spends anything on it. Values of other types
    are the engine's to refuse."""
    if not isinstance(payload, dict):
        return
    for name in ("n", "best_of"):
        value = _count(payload.get(name))
        if value is not None and value > settings.max_n:
            raise OpenAIError(
                400,
                f"'{name}' is {value}: at most {settings.max_n} choices per request here (MMCPU_MAX_N).",
                param=name,
            )
    for name in ("max_tokens", "max_completion_tokens"):
        value = _count(payload.get(name))
        if value is None:
            continue
        if settings.max_output_tokens is not None and value > settings.max_output_tokens:
            raise OpenAIError(
                400,
                f"'{name}' is {value}: at most {settings.max_output_tokens} here (MMCPU_MAX_OUTPUT_TOKENS).",
                param=name,
            )
        if model_len is not None and value > model_len:
            raise OpenAIError(
                400,
                f"'{name}' is {value}, more than the model length of '{model}' ({model_len} tokens, prompt included).",
                param=name,
            )


@router.post("/v1/audio/transcriptions")
@router.post("/v1/audio/translations")
@router.post("/v1/chat/completions")
async def proxy(request: Request, upstreams: UpstreamsDep, settings: SettingsDep) -> StreamingResponse:
    content_type = request.headers.get("content-type", "")
    payload: object = None
    model: object
    content: bytes | AsyncIterator[bytes]
    if content_type.lower().startswith("multipart/form-data"):
        model, content = await _multipart_model(request, content_type)
    else:
        model, content, payload = await _json_model(request, settings)
    if model is None or model == "":
        raise _bad_model("is required")
    if not isinstance(model, str):
        raise _bad_model("must be a string")
    engine = await upstreams.engine_for_model(model)
    check_work(payload, settings, upstreams.max_model_len(engine, model), model)
    # A body that parsed as JSON is sent as such even if the client did not say so (vLLM's FastAPI insists on it).
    return await upstreams.forward(engine, request, content, default_content_type="application/json")
