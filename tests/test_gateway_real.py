"""The gateway in front of the session's REAL vLLM engines (MRV2, patched): one base URL for both modalities."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmcpu.config import Settings
from mmcpu.gateway.app import create_app
from mmcpu_dev import speech
from mmcpu_dev.checks import WER_LIMIT, expect_client_error, subtitle_text
from mmcpu_dev.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu_dev.servers import Engine, ServedApp, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(whisper_engine, llava_engine):
    engines = f"audio={whisper_engine.base_url},vision={llava_engine.base_url}"
    served = ServedApp(create_app(Settings(engines=engines)))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_merged_and_health(client, gateway, whisper_engine, llava_engine):
    assert {m.id for m in client.models.list()} == {whisper_engine.name, llava_engine.name}
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_both_modalities_through_one_base_url(client, clips, whisper_engine, llava_engine):
    (path, text) = clips[0]
    result = client.audio.transcriptions.create(**transcription_kwargs(path, model=whisper_engine.name))
    assert speech.word_error_rate([text], [result.text]) < WER_LIMIT
    vtt = client.audio.transcriptions.create(
        **transcription_kwargs(path, model=whisper_engine.name, response_format="vtt")
    )
    assert speech.word_error_rate([text], [subtitle_text(vtt, "vtt")]) < WER_LIMIT
    reply = client.chat.completions.create(**image_chat_kwargs([test_image(1), test_image(2)], model=llava_engine.name))
    assert reply.choices[0].message.content.strip()


def test_streaming_chat_through_gateway(client, llava_engine):
    stream = client.chat.completions.create(
        **image_chat_kwargs([test_image(7), test_image(8)], model=llava_engine.name, stream=True)
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces).strip()


def test_engine_errors_pass_through(client, whisper_engine, llava_engine):
    expect_client_error(
        lambda: client.audio.transcriptions.create(**transcription_kwargs(b"", model=whisper_engine.name)), {400}
    )
    expect_client_error(
        lambda: client.chat.completions.create(
            **image_chat_kwargs(["data:image/png;base64,@@"], model=llava_engine.name)
        ),
        {400},
    )
    error = expect_client_error(
        lambda: client.chat.completions.create(**image_chat_kwargs([test_image(1)], model="no-such-model")), {404}
    )
    assert error["code"] == "model_not_found"
    assert whisper_engine.alive() and llava_engine.alive()


def finished_requests(engine: Engine) -> float:
    """Requests the vLLM engine itself counted as finished (its own /metrics)."""
    text = httpx.get(f"{engine.base_url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:request_success"
        for s in f.samples
        if s.name == "vllm:request_success_total"
    )


def test_two_audio_engines_routed_by_model(whisper_engine, int8_engine, clips):
    """Two Whisper engines behind one URL (tiny.en and its int8 sibling, the session's): each model reaches its own
    engine."""
    second = int8_engine
    served = ServedApp(create_app(Settings(engines=f"first={whisper_engine.base_url},second={second.base_url}")))
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert {m.id for m in client.models.list()} == {whisper_engine.name, second.name}
        engines = (whisper_engine, second)
        before = [finished_requests(e) for e in engines]
        sent = {whisper_engine.name: 1, second.name: 2}
        for model, count in sent.items():
            for path, text in clips[:count]:
                result = client.audio.transcriptions.create(**transcription_kwargs(path, model=model))
                assert speech.word_error_rate([text], [result.text]) < WER_LIMIT, (model, result.text)
        after = [finished_requests(e) for e in engines]
        assert [b - a for a, b in zip(before, after, strict=True)] == [sent[e.name] for e in engines]
    finally:
        served.stop()


def running_requests(engine: Engine) -> float:
    return engine.sample("vllm:num_requests_running")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_client_disconnect_aborts_the_engine_request(gateway, llava_engine, stream):
    """A long generation (ignore_eos, most of the model length) whose client hangs up once the engine runs it:
    the real engine's running count drops, and it generated far fewer tokens than the request asked for (so the
    drop is the abort, not the end of the generation)."""
    assert running_requests(llava_engine) == 0
    max_tokens = 900
    body = image_chat_kwargs([], model=llava_engine.name, max_tokens=max_tokens, stream=stream, temperature=0.0)
    generated = llava_engine.sample("vllm:generation_tokens_total")
    body["ignore_eos"] = True  # vLLM's extra parameter: the generation runs the whole max_tokens
    finished = threading.Event()

    def client() -> None:
        with contextlib.suppress(httpx.HTTPError):
            with httpx.Client(timeout=httpx.Timeout(60, read=None)) as c:
                with c.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as r:
                    next(r.iter_raw())  # the first event, then hang up
        finished.set()

    # non-streamed: the answer's headers come only at the end, so the hang-up happens while the gateway waits
    if stream:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
    else:
        thread = threading.Thread(target=_nonstream_hangup, args=(gateway, body, llava_engine, finished), daemon=True)
        thread.start()
    assert finished.wait(90), "the client did not get to hang up"
    took = wait_for(lambda: running_requests(llava_engine) == 0, 15, "the engine's running count to drop", poll_s=0.1)
    tokens = llava_engine.sample("vllm:generation_tokens_total") - generated
    print(
        f"\n[{'streamed' if stream else 'non-streamed'}: engine request aborted {took:.2f} s after the hang-up, "
        f"{tokens:.0f} of {max_tokens} tokens generated]"
    )
    assert tokens < max_tokens * 0.8, tokens
    assert llava_engine.alive()


def _nonstream_hangup(gateway, body, engine, finished) -> None:
    """Send a non-streamed chat on a raw connection, wait until the engine runs it, then close the socket."""
    payload = json.dumps(body).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: running_requests(engine) == 1, 60, "the request to run", poll_s=0.1)
    finished.set()
