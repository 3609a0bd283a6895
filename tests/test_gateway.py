"""The gateway, run for real (uvicorn on loopback) in front of real local HTTP servers standing in for the engines.

The stand-ins speak the same HTTP as vLLM's OpenAI server (/health, /v1/models, /v1/audio/*, /v1/chat/completions
with SSE, vLLM-style error bodies) and record what reached them, so the tests can check what the gateway forwarded.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
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
from mmcpu.payloads import image_chat_kwargs, transcription_kwargs
from mmcpu.payloads import test_image as make_image
from mmcpu.servers import ServedApp

AUDIO_MODEL = "whisper-test"
VISION_MODEL = "llava-test"
SHARED_MODEL = "shared"  # listed by both engines: the audio engine (listed first) serves it
LIMIT_MB = 0.25
LIMIT = int(LIMIT_MB * 1024 * 1024)
ERROR_KEYS = {"message", "type", "param", "code"}

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
        self.served = ServedApp(self._app())

    @property
    def url(self) -> str:
        return self.served.url

    def _not_found(self, model: str) -> JSONResponse:
        body = {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                          "param": "model", "code": 404}}
        return JSONResponse(body, status_code=404)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            self.model_listings += 1
            return {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": f"vllm-{self.name}"} for m in self.models
            ]}

        @app.post("/v1/audio/transcriptions")
        @app.post("/v1/audio/translations")
        async def audio(request: Request) -> Response:
            raw = await request.body()
            form = await request.form()
            upload = form["file"]
            data = await upload.read()
            self.requests.append({
                "path": request.url.path, "raw": raw, "file_sha": hashlib.sha256(data).hexdigest(),
                "content_length": request.headers.get("content-length"),
                "transfer_encoding": request.headers.get("transfer-encoding"),
                "form": {k: v for k, v in form.items() if k != "file"},
            })
            if form["model"] not in self.models:
                return self._not_found(str(form["model"]))
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
                return JSONResponse({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                               "param": "max_tokens", "code": 400}}, status_code=400)
            content = body["messages"][-1]["content"]
            prompt = " ".join(p["text"] for p in content if p["type"] == "text")
            if "crash" in prompt:
                return JSONResponse({"error": {"message": "EngineCore died", "type": "InternalServerError",
                                               "param": None, "code": 500}}, status_code=500)
            if "slow" in prompt:
                await asyncio.sleep(3)
            images = sum(1 for p in content if p["type"] == "image_url")
            words = f"{self.name} saw {images} images".split()
            if body.get("stream"):
                return StreamingResponse(self._sse(model, words), media_type="text/event-stream")
            return JSONResponse({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(words)},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": len(words), "total_tokens": 1 + len(words)},
            })

        return app

    async def _sse(self, model: str, words: list[str]) -> AsyncIterator[str]:
        self.release.clear()
        self.stream_finished.clear()
        self.stream_abandoned.clear()
        try:
            for i, word in enumerate(words):
                if i == 2:  # hold the rest until the test has seen the first chunks (or 5 s pass)
                    for _ in range(500):
                        if self.release.is_set():
                            break
                        await asyncio.sleep(0.01)
                chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                         "choices": [{"index": 0, "delta": {"content": (" " if i else "") + word},
                                      "finish_reason": None}]}
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
    values: dict[str, Any] = {"audio_url": audio.url, "vision_url": vision.url, "max_upload_mb": LIMIT_MB,
                              "request_timeout_s": 10, "health_timeout_s": 2, "api_key": None} | overrides
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
        for family in text_string_to_metric_families(text) for s in family.samples
    }


SPEECH = bytes(range(256)) * 200  # 51 200 arbitrary bytes: the gateway must not look inside


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
    boundary = "mmcpu-boundary"
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{AUDIO_MODEL}\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
        f"Content-Type: audio/wav\r\n\r\n"
    ).encode() + SPEECH + f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: the upload arrives chunked
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    r = httpx.post(f"{gateway.url}/v1/audio/transcriptions", content=chunks(),
                   headers={"content-type": f"multipart/form-data; boundary={boundary}"})
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
    assert vision.stream_abandoned.wait(3), "the gateway kept the engine's stream open"
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
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400, None, "invalid_request_error")
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": []})
    assert assert_openai_error(r, 400, None)["param"] == "model"
    r = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert_openai_error(r, 404, None)


def test_engine_errors_pass_through(gateway: ServedApp, engines) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, max_tokens=5000))
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                  "param": "max_tokens", "code": 400}}
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt="crash now"))
    assert r.status_code == 500 and r.json()["error"]["message"] == "EngineCore died"
    # the audio engine decides about its own models; its 404 comes back as it was
    with pytest.raises(openai.NotFoundError) as caught:
        client_for(gateway).audio.transcriptions.create(**transcription_kwargs(SPEECH, model="whisper-nope"))
    assert caught.value.status_code == 404 and "whisper-nope" in caught.value.message


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
    # chunked, so only counting while the body streams in can catch it
    for path in ("/v1/audio/transcriptions", "/v1/chat/completions"):
        r = httpx.post(f"{gateway.url}{path}", content=iter([big[:LIMIT // 2]] * 3),
                       headers={"content-type": "multipart/form-data; boundary=x"})
        assert_openai_error(r, 413, "request_too_large")
    assert (len(audio.requests), len(vision.requests)) == seen
    # the gateway still serves afterwards
    assert client_for(gateway).models.list().data


def test_timeout_504(engines) -> None:
    served = ServedApp(create_app(_settings(*engines, request_timeout_s=0.5)))
    try:
        r = httpx.post(f"{served.url}/v1/chat/completions",
                       json=image_chat_kwargs([make_image(1)], model=VISION_MODEL, prompt="slow"), timeout=10)
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


def test_engine_down_only_its_routes_503() -> None:
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision)))
    client = client_for(served)
    chat = image_chat_kwargs([make_image(1), make_image(2)], model=VISION_MODEL)
    try:
        assert client.chat.completions.create(**chat).choices[0].message.content  # table learned while up
        vision.served.stop()

        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat)
        error = assert_openai_error(r, 503, "engine_unavailable", "server_error")
        assert "vision" in error["message"]
        # a model never seen might live on the engine that is down: 503, not a misleading 404
        r = httpx.post(f"{served.url}/v1/chat/completions", json=image_chat_kwargs([], model="unseen"))
        assert_openai_error(r, 503, "engine_unavailable")
        # the other modality keeps serving
        assert client.audio.transcriptions.create(**transcription_kwargs(SPEECH, model=AUDIO_MODEL)).text
        assert [m.id for m in client.models.list()] == [AUDIO_MODEL, SHARED_MODEL]
        r = httpx.get(f"{served.url}/health")
        assert r.status_code == 503 and r.json()["down"] == ["vision"]
        assert httpx.get(f"{served.url}/ping").status_code == 200  # the gateway itself is alive
        assert r.json()["engines"]["audio"]["up"] is True and r.json()["engines"]["vision"]["error"]
        samples = metric_samples(httpx.get(f"{served.url}/metrics").text)
        assert samples[("mmcpu_gateway_engine_up", (("engine", "vision"),))] == 0
        assert samples[("mmcpu_gateway_engine_up", (("engine", "audio"),))] == 1
        assert samples[("mmcpu_gateway_upstream_errors_total", (("engine", "vision"), ("kind", "connect")))] >= 1

        vision.served.start()  # same port: the gateway recovers without a restart
        assert client.chat.completions.create(**chat).choices[0].message.content == "vision saw 2 images"
        assert httpx.get(f"{served.url}/health").status_code == 200
    finally:
        served.stop()
        audio.served.stop()
        if vision.served.thread.is_alive():
            vision.served.stop()


def test_all_engines_down() -> None:
    audio, vision = _engines()
    served = ServedApp(create_app(_settings(audio, vision)))
    try:
        audio.served.stop()
        vision.served.stop()
        assert_openai_error(httpx.get(f"{served.url}/v1/models"), 503, "engine_unavailable")
        r = httpx.post(f"{served.url}/v1/audio/transcriptions", files={"file": ("a.wav", SPEECH)},
                       data={"model": AUDIO_MODEL})
        assert_openai_error(r, 503, "engine_unavailable")
        assert httpx.get(f"{served.url}/health").json()["down"] == ["audio", "vision"]
        assert httpx.get(f"{served.url}/ping").json() == {"status": "ok"}
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
