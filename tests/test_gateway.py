"""The gateway, run for real (uvicorn on loopback) in front of real local HTTP servers standing in for the engines.

The stand-ins speak the same HTTP as vLLM's OpenAI server (/health, /v1/models, /v1/audio/*, /v1/chat/completions
with SSE, vLLM-style error bodies) and record what reached them, so the tests can check what the gateway forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from mmcpu.config import Settings
from mmcpu.gateway.app import create_app
from mmcpu.gateway.routes.proxy import _ModelField
from mmcpu.gateway.upstream import RECHECK_S
from mmcpu_dev.payloads import image_chat_kwargs, transcription_kwargs
from mmcpu_dev.payloads import test_image as make_image
from mmcpu_dev.servers import ServedApp, wait_for, wait_until_ok

AUDIO_MODEL = "whisper-test"
VISION_MODEL = "llava-test"
SHARED_MODEL = "shared"  # listed by both engines: the audio engine (listed first) serves it
LIMIT_MB = 0.25
LIMIT = int(LIMIT_MB * 1024 * 1024)
ERROR_KEYS = {"message", "type", "param", "code"}
# How long a stand-in engine holds a streamed answer after its first two chunks unless the test releases it: longer
# than any wait below, so a stream is never over by itself while a test still relies on it being held.
HOLD_S = 30

pytestmark = pytest.mark.timeout(60)


# --- real servers on loopback ------------------------------------------------------------------------
class StandInEngine:
    """What a vLLM OpenAI server answers, reduced to what the gateway relies on."""

    def __init__(self, name: str, models: list[str]) -> None:
        self.name = name
        self.models = list(models)
        self.requests: list[dict[str, Any]] = []  # what reached this engine
        self.model_listings = 0
        self.release = threading.Event()  # lets a held SSE stream finish
        self.stream_finished = threading.Event()
        self.stream_abandoned = threading.Event()  # the stream's reader went away before the end
        self.max_model_len: int | None = None  # listed in /v1/models when set, as vLLM does
        self.holding = 0  # "hold" chats running now (they wait for `release`, or for their client to go)
        self.held_abandoned = threading.Event()  # a held chat's client went away
        self.served = ServedApp(self._app())

    @property
    def url(self) -> str:
        return self.served.url

    def _not_found(self, model: str) -> JSONResponse:
        body = {
            "error": {
                "message": f"The model `{model}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
        return JSONResponse(body, status_code=404)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            self.model_listings += 1
            extra = {} if self.max_model_len is None else {"max_model_len": self.max_model_len}
            return {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": f"vllm-{self.name}", **extra}
                    for m in self.models
                ],
            }

        @app.post("/v1/audio/transcriptions")
        @app.post("/v1/audio/translations")
        async def audio(request: Request) -> Response:
            raw = await request.body()
            form = await request.form()
            upload = form["file"]
            data = await upload.read()
            self.requests.append(
                {
                    "path": request.url.path,
                    "raw": raw,
                    "file_sha": hashlib.sha256(data).hexdigest(),
                    "content_length": request.headers.get("content-length"),
                    "transfer_encoding": request.headers.get("transfer-encoding"),
                    "form": {k: v for k, v in form.items() if k != "file"},
                }
            )
            if form["model"] not in self.models:
                return self._not_found(str(form["model"]))
            if form.get("response_format") == "bogus":
                return JSONResponse(
                    {
                        "error": {
                            "message": "unknown response_format",
                            "type": "BadRequestError",
                            "param": "response_format",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            text = f"{self.name} heard {len(data)} bytes of {upload.filename}"
            if form.get("response_format") == "text":
                return PlainTextResponse(text)
            return JSONResponse({"text": text})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(
                {"path": request.url.path, "body": body, "content_type": request.headers.get("content-type")}
            )
            model = body["model"]
            if model not in self.models:
                return self._not_found(model)
            if body.get("max_tokens", 0) > 1000:
                return JSONResponse(
                    {
                        "error": {
                            "message": "max_tokens is too large",
                            "type": "BadRequestError",
                            "param": "max_tokens",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            content = body["messages"][-1]["content"]
            prompt = " ".join(p["text"] for p in content if p["type"] == "text")
            if "crash" in prompt:
                return JSONResponse(
                    {
                        "error": {
                            "message": "EngineCore died",
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    },
                    status_code=500,
                )
            if "slow" in prompt:
                await asyncio.sleep(3)
            if "hold" in prompt:  # like vLLM's with_cancellation: a client that goes away aborts the request
                self.holding += 1
                try:
                    deadline = time.monotonic() + HOLD_S
                    while not self.release.is_set() and time.monotonic() < deadline:
                        if await request.is_disconnected():
                            self.held_abandoned.set()
                            return Response(status_code=499)
                        await asyncio.sleep(0.01)
                finally:
                    self.holding -= 1
            images = sum(1 for p in content if p["type"] == "image_url")
            words = f"{self.name} saw {images} images".split()
            if body.get("stream"):
                return StreamingResponse(self._sse(model, words), media_type="text/event-stream")
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": " ".join(words)},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": len(words), "total_tokens": 1 + len(words)},
                }
            )

        return app

    async def _sse(self, model: str, words: list[str]) -> AsyncIterator[str]:
        self.release.clear()
        self.stream_finished.clear()
        self.stream_abandoned.clear()
        try:
            for i, word in enumerate(words):
                if i == 2:  # hold the rest until the test has seen the first chunks (or HOLD_S pass)
                    deadline = time.monotonic() + HOLD_S
                    while not self.release.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                chunk = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "delta": {"content": (" " if i else "") + word}, "finish_reason": None}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            self.stream_finished.set()
            yield "data: [DONE]\n\n"
        except BaseException:  # cancelled by uvicorn because the gateway hung up
            self.stream_abandoned.set()
            raise


# --- fixtures --------------------------------------------------------------------------------------------
def _engines() -> tuple[StandInEngine, StandInEngine]:
    return StandInEngine("audio", [AUDIO_MODEL, SHARED_MODEL]), StandInEngine("vision", [VISION_MODEL, SHARED_MODEL])


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[StandInEngine, StandInEngine]]:
    pair = _engines()
    yield pair
    for engine in pair:
        engine.served.stop()


def _settings(audio: StandInEngine, vision: StandInEngine, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engines": f"audio={audio.url},vision={vision.url}",
        "max_upload_mb": LIMIT_MB,
        "request_timeout_s": 10,
        "health_timeout_s": 2,
        "api_key": None,
    } | overrides
    return Settings(**values)


@pytest.fixture(scope="module")
def gateway(engines: tuple[StandInEngine, StandInEngine]) -> Iterator[ServedApp]:
    served = ServedApp(create_app(_settings(*engines)))
    yield served
    served.stop()


@functools.cache
def client_for(gateway: ServedApp, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)


def assert_openai_error(response: httpx.Response, status: int, code: str | None, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == code and body["error"]["message"], body
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


SPEECH = bytes(range(256)) * 200  # 51 200 arbitrary bytes: the gateway must not look inside
BOUNDARY = "mmcpu-boundary"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def multipart(*parts: tuple[str, bytes | str, str | None]) -> bytes:
    """A multipart/form-data body of (name, value, filename) parts, in the given order."""
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        kind = "Content-Type: audio/wav\r\n" if filename else ""
        data = value.encode() if isinstance(value, str) else value
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n{kind}\r\n".encode() + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def chunked(body: bytes, size: int = 4096) -> Iterator[bytes]:
    """No Content-Length: the body arrives chunked."""
    for i in range(0, len(body), size):
        yield body[i : i + size]


# --- happy paths with the real openai client ---------------------------------------------------------------
def test_transcription_forwarded_byte_for_byte(gateway: ServedApp, engines) -> None:
    audio, vision = engines
    before = len(vision.requests)
    result = client_for(gateway).audio.transcriptions.create(
        **transcription_kwargs(SPEECH, model=AUDIO_MODEL, language="en")
    )
    assert result.text == f"audio heard {len(SPEECH)} bytes of speech.wav"
    seen = audio.requests[-1]
    assert seen["path"] == "/v1/audio/transcriptions"
    assert seen["file_sha"] == hashlib.sha256(SPEECH).hexdigest()
    assert seen["form"]["language"] == "en" and seen["form"]["model"] == AUDIO_MODEL
    assert seen["content_length"] == str(len(seen["raw"]))  # the client's length travels on
    assert len(vision.requests) == before


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # openai marks translations deprecated
def test_transcription_text_format_and_translation(gateway: ServedApp, engines) -> None:
    audio, _ = engines
    client = client_for(gateway)
    text = client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL, response_format="text"))
    assert text.strip() == f"audio heard {len(SPEECH)} bytes of speech.wav"
    translated = client.audio.translations.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL))
    assert translated.text.startswith("audio heard")
    assert audio.requests[-1]["path"] == "/v1/audio/translations"


def test_chunked_multipart_reaches_engine_unchanged(gateway: ServedApp, engines) -> None:
    audio, _ = engines
    body = multipart(("model", AUDIO_MODEL, None), ("file", SPEECH, "a.wav"))
    r = httpx.post(f"{gateway.url}/v1/audio/transcriptions", content=chunked(body), headers=MULTIPART)
    assert r.status_code == 200, r.text
    seen = audio.requests[-1]
    assert seen["raw"] == body  # not parsed, not re-encoded
    assert seen["transfer_encoding"] == "chunked" and seen["content_length"] is None


def test_image_chat_routed_to_vision(gateway: ServedApp, engines) -> None:
    audio, vision = engines
    before = len(audio.requests)
    kwargs = image_chat_kwargs([make_image(1), make_image(2)], model=VISION_MODEL)
    reply = client_for(gateway).chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == "vision saw 2 images"
    assert vision.requests[-1]["body"] == json.loads(json.dumps(kwargs))  # the body arrives unchanged
    assert len(audio.requests) == before


def test_shared_model_goes_to_first_engine(gateway: ServedApp) -> None:
    reply = client_for(gateway).chat.completions.create(**image_chat_kwargs([make_image(3)], model=SHARED_MODEL))
    assert reply.choices[0].message.content == "audio saw 1 images"


def test_engines_setting() -> None:
    settings = Settings(engines=" a=http://x:1/ , b=https://y:2,")
    assert settings.engines == {"a": "http://x:1", "b": "https://y:2"}
    assert Settings().engines == {"audio": "http://127.0.0.1:8001", "vision": "http://127.0.0.1:8002"}
    for bad in ("", "a", "a=", "=http://x", "a=ftp://x", "a=http://x,a=http://y"):
        with pytest.raises(ValueError, match="engines"):
            Settings(engines=bad)


def test_audio_routed_by_model_to_either_of_two_audio_engines() -> None:
    first, second = StandInEngine("first", ["whisper-a"]), StandInEngine("second", ["whisper-b"])
    served = ServedApp(create_app(Settings(engines=f"first={first.url},second={second.url}", api_key=None)))
    client = client_for(served)
    try:
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model="whisper-b")).text.startswith(
            "second heard"
        )
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model="whisper-a")).text.startswith(
            "first heard"
        )
        assert [len(first.requests), len(second.requests)] == [1, 1]
        # the model field after the file (the gateway reads up to it, then sends all bytes on), chunked
        body = multipart(("file", SPEECH, "a.wav"), ("model", "whisper-b", None), ("language", "en", None))
        r = httpx.post(f"{served.url}/v1/audio/translations", content=chunked(body), headers=MULTIPART)
        assert r.status_code == 200 and r.json()["text"].startswith("second heard"), r.text
        assert second.requests[-1]["raw"] == body and second.requests[-1]["form"]["language"] == "en"
        assert len(first.requests) == 1
    finally:
        served.stop()
        first.served.stop()
        second.served.stop()


def test_model_field_found_across_any_chunking() -> None:
    # Reads off the socket split part headers and values anywhere: feed the search one byte at a time.
    body = multipart(("file", b"x" * 50, "a.wav"), ("model", "whisper-b", None), ("model", "later", None))
    field = _ModelField(BOUNDARY.encode())
    for i in range(len(body)):
        field.parser.write(body[i : i + 1])
        if field.done:
            break
    assert field.done and bytes(field.value) == b"whisper-b" and not field.is_file


def test_bad_model_in_upload_400(gateway: ServedApp, engines) -> None:
    audio, vision = engines
    seen = len(audio.requests), len(vision.requests)
    url = f"{gateway.url}/v1/audio/transcriptions"
    cases = {
        "missing": (multipart(("file", SPEECH, "a.wav")), MULTIPART),
        "empty": (multipart(("model", "", None), ("file", SPEECH, "a.wav")), MULTIPART),
        "a file": (multipart(("model", AUDIO_MODEL, "model.txt"), ("file", SPEECH, "a.wav")), MULTIPART),
        "not UTF-8": (multipart(("model", b"\xff\xfe", None), ("file", SPEECH, "a.wav")), MULTIPART),
        "no boundary": (b"whatever", {"content-type": "multipart/form-data"}),
        "malformed": (b"\0" * 100, MULTIPART),
    }
    for case, (body, headers) in cases.items():
        r = httpx.post(url, content=body, headers=headers)
        assert_openai_error(r, 400, None, "invalid_request_error")
        if case not in ("no boundary", "malformed"):
            assert r.json()["error"]["param"] == "model", case
    r = httpx.post(url, files={"file": ("a.wav", SPEECH)}, data={"model": "whisper-nope"})
    assert "whisper-nope" in assert_openai_error(r, 404, "model_not_found")["message"]
    for model in (7, ["a"], None, ""):
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=image_chat_kwargs([], model=model))
        assert assert_openai_error(r, 400, None)["param"] == "model"
    assert (len(audio.requests), len(vision.requests)) == seen  # no engine saw any of these


def test_streaming_chunks_arrive_before_upstream_finishes(gateway: ServedApp, engines) -> None:
    _, vision = engines
    stream = client_for(gateway).chat.completions.create(
        **image_chat_kwargs([make_image(1), make_image(2)], model=VISION_MODEL, stream=True)
    )
    chunks = iter(stream)
    first, second = next(chunks), next(chunks)
    # The engine is still holding the rest of its answer: a buffering gateway could not have delivered these.
    assert not vision.stream_finished.is_set()
    vision.release.set()
    rest = list(chunks)
    assert vision.stream_finished.is_set()
    text = "".join(c.choices[0].delta.content or "" for c in [first, second, *rest])
    assert text == "vision saw 2 images"


def test_client_gone_closes_engine_stream(gateway: ServedApp, engines) -> None:
    _, vision = engines
    stream = client_for(gateway).chat.completions.create(
        **image_chat_kwargs([make_image(1)], model=VISION_MODEL, stream=True)
    )
    next(iter(stream))
    stream.close()  # the client hangs up while the engine is still generating
    # Set only when the engine's stream is cancelled (never when it runs to its end), so a long wait cannot let a
    # gateway that keeps the stream open pass; it only has to cover a slow machine's few event-loop turns.
    assert vision.stream_abandoned.wait(10), "the gateway kept the engine's stream open"
    assert not vision.stream_finished.is_set()


def test_models_merged(gateway: ServedApp) -> None:
    ids = [m.id for m in client_for(gateway).models.list()]
    assert ids == [AUDIO_MODEL, SHARED_MODEL, VISION_MODEL]
    assert client_for(gateway).models.retrieve(VISION_MODEL).owned_by == "vllm-vision"
    r = httpx.get(f"{gateway.url}/v1/models/no-such-model")
    assert_openai_error(r, 404, "model_not_found")


def test_model_table_cached_and_refreshed_on_miss(gateway: ServedApp, engines) -> None:
    _, vision = engines
    client = client_for(gateway)
    client.chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
    listings = vision.model_listings
    client.chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
    assert vision.model_listings == listings  # within the TTL: no new listing
    vision.models.append("late-model")
    try:
        reply = client.chat.completions.create(**image_chat_kwargs([make_image(1)], model="late-model"))
        assert reply.choices[0].message.content == "vision saw 1 images"
        assert vision.model_listings == listings + 1
    finally:
        vision.models.remove("late-model")


# --- errors -------------------------------------------------------------------------------------------------
def test_unknown_model_404(gateway: ServedApp) -> None:
    with pytest.raises(openai.NotFoundError):
        client_for(gateway).chat.completions.create(**image_chat_kwargs([make_image(1)], model="gpt-nope"))
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=image_chat_kwargs([], model="gpt-nope"))
    error = assert_openai_error(r, 404, "model_not_found", "invalid_request_error")
    assert error["param"] == "model" and "gpt-nope" in error["message"]


def test_bad_chat_bodies_400(gateway: ServedApp) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 400, None, "invalid_request_error")
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": []})
    assert assert_openai_error(r, 400, None)["param"] == "model"
    r = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert_openai_error(r, 404, None)


def test_engine_errors_pass_through(gateway: ServedApp, engines) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, max_tokens=5000),
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    }
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt="crash now"),
    )
    assert r.status_code == 500 and r.json()["error"]["message"] == "EngineCore died"
    # an engine's own 4xx on audio comes back as it was too
    r = httpx.post(
        f"{gateway.url}/v1/audio/transcriptions",
        files={"file": ("a.wav", SPEECH)},
        data={"model": AUDIO_MODEL, "response_format": "bogus"},
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "unknown response_format"


def test_body_limit_413(gateway: ServedApp, engines) -> None:
    audio, vision = engines
    seen = len(audio.requests), len(vision.requests)
    big = b"\0" * (LIMIT + 1)
    # announced by Content-Length: refused before any engine is contacted
    with pytest.raises(openai.APIStatusError) as caught:
        client_for(gateway).audio.transcriptions.create(**transcription_kwargs(big, model=AUDIO_MODEL))
    assert caught.value.status_code == 413
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "request_too_large")
    # chunked, so only counting while the body streams in can catch it: while the gateway reads a chat body or
    # looks for an upload's model field (here after the file), and while it streams an upload to the engine
    chunked_bodies = [
        ("/v1/chat/completions", big, {"content-type": "application/json"}),
        ("/v1/audio/transcriptions", multipart(("file", big, "a.wav"), ("model", AUDIO_MODEL, None)), MULTIPART),
        ("/v1/audio/translations", multipart(("model", AUDIO_MODEL, None), ("file", big, "a.wav")), MULTIPART),
    ]
    for path, body, headers in chunked_bodies:
        r = httpx.post(f"{gateway.url}{path}", content=chunked(body, LIMIT // 2), headers=headers)
        assert_openai_error(r, 413, "request_too_large")
    assert (len(audio.requests), len(vision.requests)) == seen
    # the gateway still serves afterwards
    assert client_for(gateway).models.list().data


def test_timeout_504(engines) -> None:
    served = ServedApp(create_app(_settings(*engines, request_timeout_s=0.5)))
    try:
        r = httpx.post(
            f"{served.url}/v1/chat/completions",
            json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt="slow"),
            timeout=10,
        )
        assert_openai_error(r, 504, "engine_timeout", "server_error")
    finally:
        served.stop()


def test_api_key(engines) -> None:
    served = ServedApp(create_app(_settings(*engines, api_key="s3cret")))
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
            r = httpx.get(f"{served.url}/v1/models", headers=headers)
            error = assert_openai_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer" and "s3cret" not in error["message"]
        with pytest.raises(openai.AuthenticationError):
            client_for(served, "wrong").chat.completions.create(**image_chat_kwargs([], model=VISION_MODEL))
        # 401 comes before the size check: a keyless client learns nothing about the limit
        r = httpx.post(f"{served.url}/v1/audio/transcriptions", content=b"\0" * (LIMIT + 1))
        assert_openai_error(r, 401, "invalid_api_key")
        client = client_for(served, "s3cret")
        assert [m.id for m in client.models.list()] == [AUDIO_MODEL, SHARED_MODEL, VISION_MODEL]
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL)).text
        assert httpx.get(f"{served.url}/health").status_code == 200  # ops routes stay open
        assert httpx.get(f"{served.url}/metrics").status_code == 200
        assert httpx.get(f"{served.url}/ping").status_code == 200
    finally:
        served.stop()


def test_no_api_key_configured_means_open(gateway: ServedApp, engines) -> None:
    r = httpx.get(f"{gateway.url}/v1/models")  # no Authorization header at all
    assert r.status_code == 200 and r.json()["object"] == "list"
    served = ServedApp(create_app(_settings(*engines, api_key="")))  # an empty MMCPU_API_KEY also means no key
    try:
        assert client_for(served, "any-key").models.list().data
    finally:
        served.stop()


def test_chat_without_content_type_still_json_upstream(gateway: ServedApp, engines) -> None:
    _, vision = engines
    body = json.dumps(image_chat_kwargs([make_image(4)], model=VISION_MODEL)).encode()
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=body)  # httpx sets no content-type here
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "vision saw 1 images"
    assert vision.requests[-1]["content_type"] == "application/json"


# --- health, outage, metrics, logs ----------------------------------------------------------------------------
def test_health_ok(gateway: ServedApp) -> None:
    r = httpx.get(f"{gateway.url}/health")
    assert r.status_code == 200
    assert r.json()["down"] == [] and r.json()["engines"]["vision"]["up"] is True


def timed(method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.request(method, url, timeout=10, **kwargs)
    return r, time.monotonic() - start


def failed_connects(served: ServedApp, engine: str) -> float:
    """Connections to ``engine`` that failed while forwarding a request (the gateway's own /health probes do not
    count), read from the app's registry: a /metrics request would probe the engines first and so change the very
    state a test looks at."""
    value = served.app.state.metrics.registry.get_sample_value(
        "mmcpu_gateway_upstream_errors_total", {"engine": engine, "kind": "connect"}
    )
    return value or 0.0


def test_engine_down_503_others_serve_then_recovers() -> None:
    audio, vision = _engines()
    # A long connect timeout, so that "answered without waiting" is told apart from any machine's slowness: a
    # refused connection must not cost it, and a known-down engine must not even be tried.
    connect_s = 10
    served = ServedApp(create_app(_settings(audio, vision, connect_timeout_s=connect_s)))
    client = client_for(served)
    chat = image_chat_kwargs([make_image(1), make_image(2)], model=VISION_MODEL)
    try:
        assert client.chat.completions.create(**chat).choices[0].message.content  # table learned while up
        vision.served.stop()

        r, first_s = timed("POST", f"{served.url}/v1/chat/completions", json=chat)
        error = assert_openai_error(r, 503, "engine_unavailable", "server_error")
        assert "vision" in error["message"]
        assert first_s < connect_s / 2, first_s  # refused: answered at once, not after the connect timeout
        connects = failed_connects(served, "vision")
        assert connects >= 1  # it did try the engine
        listings = vision.model_listings
        # now known down: its models answer 503 from the last list it gave (not 404), without waiting on it
        r, cached_s = timed("POST", f"{served.url}/v1/chat/completions", json=chat)
        assert_openai_error(r, 503, "engine_unavailable")
        # a model never seen might live on the engine that is down: 503, not a misleading 404
        r, unseen_s = timed("POST", f"{served.url}/v1/chat/completions", json=image_chat_kwargs([], model="unseen"))
        assert_openai_error(r, 503, "engine_unavailable")
        # Both answered from what the gateway knows: no connection to the down engine was attempted (the count is
        # exact, where a time bound would only be as good as the machine is fast).
        assert failed_connects(served, "vision") == connects, (cached_s, unseen_s)
        # the other engine keeps serving, and the gateway is ready while one engine is
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL)).text
        assert [m.id for m in client.models.list()] == [AUDIO_MODEL, SHARED_MODEL]
        r = httpx.get(f"{served.url}/health")
        assert r.status_code == 200 and r.json()["status"] == "degraded" and r.json()["down"] == ["vision"]
        state = r.json()["engines"]
        assert state["audio"]["up"] is True and "error" not in state["audio"]
        assert state["vision"]["up"] is False and state["vision"]["error"]
        assert state["vision"]["models"] == [VISION_MODEL, SHARED_MODEL]  # the last known list
        samples = metric_samples(httpx.get(f"{served.url}/metrics").text)
        assert samples[("mmcpu_gateway_engine_up", (("engine", "vision"),))] == 0
        assert samples[("mmcpu_gateway_engine_up", (("engine", "audio"),))] == 1
        assert samples[("mmcpu_gateway_upstream_errors_total", (("engine", "vision"), ("kind", "connect")))] >= 1

        # back on the same port, with one more model: the gateway notices by itself (no request, no restart)
        # and learns the new list. Waited for on the gateway's side: the engine counting a listing is not yet the
        # gateway having read the answer. The background re-probe runs every RECHECK_S; nothing else lists the
        # engine's models meanwhile (no request is sent), so a bound of 10 periods only allows for a slow machine.
        vision.models.append("late-model")
        vision.served.start()
        seen = served.app.state.upstreams.engines["vision"]
        back_s = wait_for(lambda: seen.up, 10 * RECHECK_S, "background re-probe")
        assert vision.model_listings > listings and seen.serves("late-model")
        print(
            f"\n[down engine: first 503 in {first_s * 1000:.0f} ms, then {cached_s * 1000:.0f} ms; "
            f"re-listed {back_s:.2f} s after it came back]"
        )
        assert client.chat.completions.create(**chat).choices[0].message.content == "vision saw 2 images"
        late = image_chat_kwargs([make_image(1)], model="late-model")
        assert client.chat.completions.create(**late).choices[0].message.content == "vision saw 1 images"
        assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    finally:
        served.stop()
        audio.served.stop()
        if vision.served.thread.is_alive():
            vision.served.stop()


def test_unreachable_engine_503_within_connect_timeout() -> None:
    """An engine whose port stops completing connections (full accept queue: SYNs are dropped, as for a frozen
    host) costs one request the connect timeout; the next ones are answered at once.

    The timeouts are set far apart, so each bound below tells the right timeout from the wrong one with seconds
    to spare on any machine: connect 2 s; request 10 s and probe (health) 10 s, either of which would end a hung
    connect if the connect timeout were not applied."""
    connect_s = 2
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision, connect_timeout_s=connect_s, health_timeout_s=10)))
    client = client_for(served)
    chat = image_chat_kwargs([make_image(1)], model=VISION_MODEL)
    jammed: list[socket.socket] = []
    try:
        assert client.chat.completions.create(**chat).choices[0].message.content
        vision.served.stop()
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", vision.served.port))
        listener.listen(0)  # never accepted: once the queue is full, new connections hang
        jammed.append(listener)
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", vision.served.port))
            jammed.append(filler)

        r, first_s = timed("POST", f"{served.url}/v1/chat/completions", json=chat)
        assert_openai_error(r, 503, "engine_unavailable")
        connects = failed_connects(served, "vision")
        r, cached_s = timed("POST", f"{served.url}/v1/chat/completions", json=chat)
        assert_openai_error(r, 503, "engine_unavailable")
        print(f"\n[unreachable engine: first 503 in {first_s * 1000:.0f} ms, then {cached_s * 1000:.0f} ms]")
        # The first waited out the connect timeout (it cannot end sooner), and not the 10 s ones.
        assert connect_s - 0.1 < first_s < connect_s + 3, first_s
        # The next one tried no connection at all (exact), so it did not wait on one (a connection attempt would
        # cost the whole connect timeout here: the bound has that much margin over any machine's noise).
        assert failed_connects(served, "vision") == connects >= 1
        assert cached_s < connect_s - 0.5, cached_s
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL)).text
        # /health probes every engine, the jammed one too: its connect timeout bounds the answer, not the probe's 10 s.
        r, health_s = timed("GET", f"{served.url}/health")
        assert r.status_code == 200 and r.json()["down"] == ["vision"]
        assert health_s < connect_s + 3, health_s
    finally:
        for sock in jammed:
            sock.close()
        served.stop()
        audio.served.stop()


def test_all_engines_down() -> None:
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision)))
    try:
        audio.served.stop()
        vision.served.stop()
        assert_openai_error(httpx.get(f"{served.url}/v1/models"), 503, "engine_unavailable")
        r = httpx.post(
            f"{served.url}/v1/audio/transcriptions", files={"file": ("a.wav", SPEECH)}, data={"model": AUDIO_MODEL}
        )
        assert_openai_error(r, 503, "engine_unavailable")
        r = httpx.get(f"{served.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert r.json()["down"] == ["audio", "vision"]
        assert httpx.get(f"{served.url}/ping").json() == {"status": "ok"}  # liveness: the gateway itself
    finally:
        served.stop()


def test_metrics(gateway: ServedApp) -> None:
    client = client_for(gateway)
    client.chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
    httpx.post(f"{gateway.url}/v1/chat/completions", json=image_chat_kwargs([], model="gpt-nope"))
    r = httpx.get(f"{gateway.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)
    chat = "/v1/chat/completions"
    ok = samples[("mmcpu_gateway_requests_total", (("method", "POST"), ("route", chat), ("status", "200")))]
    missing = samples[("mmcpu_gateway_requests_total", (("method", "POST"), ("route", chat), ("status", "404")))]
    assert ok >= 1 and missing >= 1
    assert samples[("mmcpu_gateway_request_duration_seconds_count", (("route", chat),))] >= ok + missing
    assert samples[("mmcpu_gateway_engine_up", (("engine", "audio"),))] == 1
    assert samples[("mmcpu_gateway_engine_up", (("engine", "vision"),))] == 1


def test_one_log_line_per_request(gateway: ServedApp, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mmcpu.gateway")
    client_for(gateway).chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
    deadline = time.monotonic() + 5
    while True:  # the line is written once the response is complete, which may trail the client a little
        lines = [r.getMessage() for r in caplog.records if r.name == "mmcpu.gateway"]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(lines) == 1, lines
    assert " POST /v1/chat/completions 200 " in lines[0] and "engine=vision" in lines[0]


# --- graceful stop of a real gateway process ------------------------------------------------------------------
def _gateway_process(engine: StandInEngine, drain_s: float, log_path) -> tuple[subprocess.Popen, str]:
    # Port 0: the gateway binds a free port itself and uvicorn logs which one (a port picked here and let go could
    # be taken by someone else before the gateway binds it).
    env = dict(
        os.environ,
        MMCPU_HOST="127.0.0.1",
        MMCPU_GATEWAY_PORT="0",
        MMCPU_ENGINES=f"vision={engine.url}",
        MMCPU_DRAIN_S=str(drain_s),
        MMCPU_API_KEY="",
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmcpu.gateway"], env=env, stdout=log, stderr=subprocess.STDOUT)
    running = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
    deadline = time.monotonic() + 60  # interpreter start and imports: ~1 s idle, several on a slow busy machine
    while not (found := running.search(log_path.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"gateway did not start (exit {proc.returncode}):\n{log_path.read_text(errors='replace')}"
            )
        time.sleep(0.05)
    url = f"http://127.0.0.1:{found.group(1)}"
    wait_until_ok(f"{url}/ping", proc, 30, "gateway", log_path)
    return proc, url


def _sigterm_during_stream(drain_s: float, tmp_path, release: bool) -> tuple[dict[str, Any], float, int, str]:
    """Hold an SSE chat stream open in the stand-in engine, SIGTERM the gateway while it runs, check that new
    connections are refused meanwhile, then (if ``release``) let the engine finish the stream.
    Returns (what the client got, seconds from SIGTERM to exit, exit code, gateway log)."""
    engine = StandInEngine("vision", [VISION_MODEL])
    log_path = tmp_path / "gateway.log"
    proc, url = _gateway_process(engine, drain_s, log_path)
    outcome: dict[str, Any] = {"chunks": []}
    first_chunk = threading.Event()

    def stream() -> None:
        body = image_chat_kwargs([make_image(1)], model=VISION_MODEL, stream=True)
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
                outcome["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        outcome["chunks"].append(json.loads(line[6:])["choices"][0]["delta"]["content"])
                        first_chunk.set()
                    elif line == "data: [DONE]":
                        outcome["done"] = True
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    def refused() -> bool:
        try:
            httpx.get(f"{url}/ping", timeout=1)
        except httpx.ConnectError:
            return True
        except httpx.TransportError:
            # Connected just before the listener closed, then dropped by the shutdown without an answer (or not
            # answered within 1 s while it shuts down): not refused yet, ask again.
            return False
        return False

    try:
        worker = threading.Thread(target=stream)
        worker.start()
        assert first_chunk.wait(10), outcome
        sigterm = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(refused, 4, "new connections refused")
        outcome["in_flight_when_refused"] = worker.is_alive() and not engine.stream_finished.is_set()
        if release:
            engine.release.set()
        worker.join(30)
        code = proc.wait(30)
        return outcome, time.monotonic() - sigterm, code, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.release.set()
        engine.served.stop()


def test_sigterm_drains_in_flight_and_refuses_new(tmp_path) -> None:
    outcome, exit_s, code, log = _sigterm_during_stream(10, tmp_path, release=True)
    assert outcome["in_flight_when_refused"], "the stream ended before new connections were refused"
    assert outcome["status"] == 200 and outcome.get("done") and "error" not in outcome, (outcome, log)
    assert "".join(outcome["chunks"]) == "vision saw 1 images"
    # it leaves once the last request is done; uvicorn re-raises the SIGTERM after its orderly shutdown
    assert code == -signal.SIGTERM and "Application shutdown complete" in log, (code, log)
    assert exit_s < 10, exit_s


def test_drain_time_bounds_the_wait(tmp_path) -> None:
    # The other side of MMCPU_DRAIN_S: a stream that outlasts the drain time is cut off when it runs out.
    drain_s = 1
    outcome, exit_s, code, log = _sigterm_during_stream(drain_s, tmp_path, release=False)
    assert outcome["in_flight_when_refused"]
    assert "error" in outcome and not outcome.get("done"), outcome  # broken off mid-stream
    # The stream got its drain time (the gateway cannot have ended it sooner), and no more: the engine would have
    # held it for HOLD_S (30 s); the upper bound leaves a slow machine 9 s to shut down after the drain.
    assert drain_s <= exit_s < drain_s + 9 < HOLD_S, (exit_s, log)


# --- staying up under load, bounded parsing and work, fail-closed access ------------------------------------
def _hold_chat(served: ServedApp, results: list, **kwargs: Any) -> threading.Thread:
    """A chat the stand-in holds until released (or its client goes), sent from a thread; its answer lands in
    ``results`` as (response or exception, seconds)."""

    def run() -> None:
        start = time.monotonic()
        try:
            r = httpx.post(
                f"{served.url}/v1/chat/completions",
                **kwargs,
                json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt="hold"),
            )
            results.append((r, time.monotonic() - start))
        except httpx.HTTPError as exc:
            results.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_admission_limit_429_at_once_then_queue_bound_503() -> None:
    """One place and one queue place at the vision engine: a third request is refused at once (429, Retry-After,
    OpenAI's schema) and the queued one is answered 503 when its wait runs out, while the other engine, /health
    and the probes are untouched. Released, the engine serves again (places given back)."""
    audio, vision = _engines()
    served = ServedApp(
        create_app(_settings(audio, vision, engine_concurrency=1, engine_queue=1, queue_timeout_s=2, retry_after_s=3))
    )
    first: list = []
    queued: list = []
    try:
        vision.release.clear()
        t1 = _hold_chat(served, first, timeout=30)
        wait_for(lambda: vision.holding == 1, 10, "the first chat at the engine")
        t2 = _hold_chat(served, queued, timeout=30)
        wait_for(lambda: served.app.state.upstreams.engines["vision"].admission.held == 2, 10, "one queued")
        r, took = timed(
            "POST", f"{served.url}/v1/chat/completions", json=image_chat_kwargs([make_image(1)], model=VISION_MODEL)
        )
        error = assert_openai_error(r, 429, "engine_overloaded", "server_error")
        assert r.headers["retry-after"] == "3" and "MMCPU_ENGINE_QUEUE" in error["message"]
        assert took < 1, took  # not queued (the queue wait is 2 s); the bound allows for a busy machine
        # the other engine, /health and the models are served meanwhile
        assert client_for(served).audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL)).text
        r, health_s = timed("GET", f"{served.url}/health")
        assert r.json()["status"] == "ok" and health_s < 1, (r.text, health_s)
        t2.join(10)
        ((r2, waited),) = queued
        assert_openai_error(r2, 503, "engine_busy", "server_error")
        assert r2.headers["retry-after"] == "3" and 1.9 < waited < 5, waited
        assert vision.holding == 1  # the queued request never reached the engine
        vision.release.set()
        t1.join(10)
        assert first[0][0].status_code == 200
        assert client_for(served).chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
        # A place is given back when the gateway has finished the response, which may be just after the client
        # has read it.
        wait_for(lambda: served.app.state.upstreams.engines["vision"].admission.held == 0, 5, "places given back")
    finally:
        vision.release.set()
        served.stop()
        audio.served.stop()
        vision.served.stop()


def test_client_gone_aborts_non_streamed_request() -> None:
    """A non-streamed chat whose client hangs up while the engine computes: the gateway closes the engine
    connection (the engine's handler sees the disconnect and its running count drops), and the place is given
    back (one place only: the next request is served)."""
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision, engine_concurrency=1, engine_queue=0)))
    results: list = []
    try:
        vision.release.clear()
        vision.held_abandoned.clear()
        _hold_chat(served, results, timeout=httpx.Timeout(10, read=1.0)).join(10)
        assert isinstance(results[0][0], httpx.ReadTimeout)  # the client gave up and closed its connection
        assert vision.held_abandoned.wait(5), "the engine kept computing for a client that is gone"
        wait_for(lambda: vision.holding == 0, 5, "the engine's running count to drop")
        wait_for(lambda: served.app.state.upstreams.engines["vision"].admission.held == 0, 5, "the place back")
        vision.release.set()
        assert client_for(served).chat.completions.create(**image_chat_kwargs([make_image(1)], model=VISION_MODEL))
    finally:
        vision.release.set()
        served.stop()
        audio.served.stop()
        vision.served.stop()


def test_json_depth_and_size_400_before_parsing(gateway: ServedApp, engines) -> None:
    audio, vision = engines
    seen = len(vision.requests)
    model = json.dumps(VISION_MODEL).encode()
    bodies = {
        "json_too_large": b'{"model": ' + model + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "json_too_deep": b'{"model": ' + model + b', "x": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}",
    }
    big = Settings.model_fields["max_json_items"].default
    wide = json.dumps({**image_chat_kwargs([make_image(1)], model=VISION_MODEL), "x": [0] * (big + 1)}).encode()
    keys = json.dumps(
        {**image_chat_kwargs([make_image(1)], model=VISION_MODEL), **{f"k{i}": 0 for i in range(big)}}
    ).encode()
    served = ServedApp(create_app(_settings(*engines, max_upload_mb=8)))
    try:
        for code, body in [*bodies.items(), ("json_too_large", wide), ("json_too_large", keys)]:
            r = httpx.post(
                f"{served.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert_openai_error(r, 400, code, "invalid_request_error")
        # brackets, quotes and backslashes inside strings are text, not structure
        text = '"[[{{' * 200 + '\\\\"' * 100
        r = httpx.post(
            f"{served.url}/v1/chat/completions",
            json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt=text),
        )
        assert r.status_code == 200, r.text
        nested = image_chat_kwargs([make_image(1)], model=VISION_MODEL)
        nested["x"] = functools.reduce(lambda inner, _: [inner], range(60), 0)  # 61 deep with the top object
        assert httpx.post(f"{served.url}/v1/chat/completions", json=nested).status_code == 200
    finally:
        served.stop()
    assert len(vision.requests) == seen + 2


def test_n_best_of_and_max_tokens_bounded() -> None:
    """n / best_of over MMCPU_MAX_N, max_tokens / max_completion_tokens over MMCPU_MAX_OUTPUT_TOKENS or over the
    model length the engine lists: 400 naming the parameter, and nothing reaches the engine."""
    audio, vision = _engines()
    vision.max_model_len = 2048
    served = ServedApp(create_app(_settings(audio, vision, max_n=4)))
    chat = image_chat_kwargs([make_image(1)], model=VISION_MODEL)
    try:
        for extra, param, where in [
            ({"n": 5}, "n", "MMCPU_MAX_N"),
            ({"best_of": 10_000}, "best_of", "MMCPU_MAX_N"),
            ({"max_tokens": 10**9}, "max_tokens", "model length"),
            ({"max_completion_tokens": 2049}, "max_completion_tokens", "model length"),
        ]:
            r = httpx.post(f"{served.url}/v1/chat/completions", json={**chat, **extra})
            error = assert_openai_error(r, 400, None, "invalid_request_error")
            assert error["param"] == param and where in error["message"], error
        assert vision.requests == []
        r = httpx.post(f"{served.url}/v1/chat/completions", json={**chat, "n": 4, "max_completion_tokens": 2048})
        assert r.status_code == 200 and vision.requests[-1]["body"]["n"] == 4
    finally:
        served.stop()
    served = ServedApp(create_app(_settings(audio, vision, max_output_tokens=100)))
    try:
        r = httpx.post(f"{served.url}/v1/chat/completions", json={**chat, "max_tokens": 101})
        error = assert_openai_error(r, 400, None)
        assert error["param"] == "max_tokens" and "MMCPU_MAX_OUTPUT_TOKENS" in error["message"]
    finally:
        served.stop()
        audio.served.stop()
        vision.served.stop()


def _trickle(
    url: str, path: str, headers: dict[str, str], body: bytes, head: int, every_s: float, limit_s: float
) -> tuple[int | None, float, bytes]:
    """``body`` announced by Content-Length, its first ``head`` bytes at once, then one byte per ``every_s`` until
    the server answers (or ``limit_s``): the status, when it came, the answer."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit_s) as sock:
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body[:head])
        sent = head
        answer = b""
        while time.monotonic() - start < limit_s:
            readable, _, _ = select.select([sock], [], [], every_s)
            if readable:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                if b"\r\n\r\n" in answer:
                    break
            elif sent < len(body):
                with contextlib.suppress(OSError):
                    sock.sendall(body[sent : sent + 1])
                sent += 1
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    return status, time.monotonic() - start, answer


def test_slow_body_408_and_upload_time_is_not_engine_stall() -> None:
    """A body that trickles past MMCPU_BODY_TIMEOUT_S is answered 408 (a chat read whole, and an upload already
    streaming to its engine, whose place is given back); an upload that takes longer than MMCPU_STALL_S but
    arrives in time is served and its engine is not marked hung."""
    audio, vision = _engines()
    served = ServedApp(
        create_app(_settings(audio, vision, body_timeout_s=1.5, stall_s=1, engine_concurrency=1, engine_queue=0))
    )
    try:
        chat = json.dumps(image_chat_kwargs([make_image(1)], model=VISION_MODEL)).encode()
        status, took, answer = _trickle(
            served.url, "/v1/chat/completions", {"Content-Type": "application/json"}, chat, 100, 0.2, 10
        )
        assert status == 408 and 1.4 < took < 4, (status, took, answer[-300:])
        assert b'"request_timeout"' in answer
        upload = multipart(("model", AUDIO_MODEL, None), ("file", SPEECH, "a.wav"))
        status, took, answer = _trickle(served.url, "/v1/audio/transcriptions", MULTIPART, upload, 1000, 0.2, 10)
        assert status == 408 and 1.4 < took < 4, (status, took, answer[-300:])
        wait_for(lambda: served.app.state.upstreams.engines["audio"].admission.held == 0, 5, "the place back")
    finally:
        served.stop()
    # An upload of ~3 s with the engine's stall bound at 1 s: the wait for the engine starts once the body is sent.
    served = ServedApp(create_app(_settings(audio, vision, body_timeout_s=20, stall_s=1)))
    try:
        upload = multipart(("model", AUDIO_MODEL, None), ("file", SPEECH[:1200], "a.wav"))
        status, took, answer = _trickle(
            served.url, "/v1/audio/transcriptions", MULTIPART, upload, len(upload) - 30, 0.1, 15
        )
        assert status == 200, answer[-400:]
        assert took > 2 and served.app.state.upstreams.engines["audio"].up, (took, answer[-400:])
    finally:
        served.stop()
        audio.served.stop()
        vision.served.stop()


def test_health_says_only_up_or_down_without_the_key(engines) -> None:
    served = ServedApp(create_app(_settings(*engines, api_key="s3cret")))
    try:
        r = httpx.get(f"{served.url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = httpx.get(f"{served.url}/health", headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200 and set(r.json()["engines"]) == {"audio", "vision"}
        assert r.json()["engines"]["vision"]["url"] == engines[1].url
    finally:
        served.stop()


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"MMCPU_HOST": "0.0.0.0"}, True),
        ({"MMCPU_HOST": "0.0.0.0", "MMCPU_API_KEY": ""}, True),
        ({"MMCPU_HOST": "0.0.0.0", "MMCPU_ALLOW_UNAUTHENTICATED": "true"}, False),
        ({"MMCPU_HOST": "0.0.0.0", "MMCPU_API_KEY": "k"}, False),
        ({"MMCPU_HOST": "127.0.0.1"}, False),
    ],
)
def test_refuses_to_listen_beyond_loopback_without_a_key(env: dict[str, str], refused: bool) -> None:
    """The real entry point (python -m mmcpu.gateway): refused, it exits at once naming the way out; allowed, it
    starts serving (stopped after /ping answers)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child_env = (
        {k: v for k, v in os.environ.items() if not k.startswith("MMCPU_")}
        | env
        | {"MMCPU_GATEWAY_PORT": str(port), "MMCPU_ENGINES": "audio=http://127.0.0.1:9"}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcpu.gateway"],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if refused:
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode != 0 and "MMCPU_ALLOW_UNAUTHENTICATED" in out, out
            return
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def test_engine_token_counters_read_with_prometheus_parser() -> None:
    """A timestamp after the value, label sets and the OpenMetrics _created sample are not taken for the count."""
    from mmcpu.health import token_count

    text = (
        "# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 120.0 1700000000000\n'
        'vllm:prompt_tokens_total{model_name="m",engine="1"} 5.0\n'
        'vllm:prompt_tokens_created{model_name="m",engine="0"} 1.7e9\n'
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} 30\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 2\n'
    )
    assert token_count(text) == 155.0


class _OneRefusal(httpx.AsyncBaseTransport):
    """A replica behind one Service URL that refuses a connection once; the next connections reach a good one."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.refused:
            self.refused += 1
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_one_refused_connection_does_not_mark_a_service_down() -> None:
    """One failed connection costs its request (503) but the probe that follows finds the engine's URL healthy,
    so the engine stays up and the next request is served; nothing waits for the background re-probe."""
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision)))
    try:
        engine = served.app.state.upstreams.engines["vision"]
        flaky = _OneRefusal()
        engine.client = httpx.AsyncClient(transport=flaky, timeout=10)
        chat = image_chat_kwargs([make_image(1)], model=VISION_MODEL)
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat)
        assert_openai_error(r, 503, "engine_unavailable")
        assert flaky.refused == 1 and engine.up, engine.error
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
    finally:
        served.stop()
        audio.served.stop()
        vision.served.stop()
