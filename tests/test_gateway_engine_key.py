"""The engines' internal key (MMCPU_ENGINE_API_KEY) on a REAL vLLM engine started by the launcher: /v1 answers 401
without it, the key is nowhere on a command line, and every internal caller (the gateway's requests and probes,
the health check's 1-token probe) sends it."""

from __future__ import annotations

import secrets

import httpx
import openai
import psutil
import pytest

from mmcpu import health
from mmcpu.config import Settings
from mmcpu.gateway.app import create_app
from mmcpu.proc import tree
from mmcpu_dev import speech
from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.payloads import transcription_kwargs
from mmcpu_dev.servers import ServedApp, test_engine

pytestmark = pytest.mark.slow

KEY = "engine-" + secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def keyed_engine(whisper_model, patched_vllm, logs_dir):
    # One engine of its own: the session's shared engines run without a key (their tests call them directly).
    engine = test_engine(whisper_model, logs_dir, "engine-key", env={"MMCPU_ENGINE_API_KEY": KEY}).start()
    yield engine
    engine.stop()


def test_engine_refuses_v1_without_the_key(keyed_engine):
    base = keyed_engine.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
    r = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", health.silent_wav())}, timeout=10)
    assert r.status_code == 401
    ok = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == keyed_engine.name
    # Probes of liveness and metrics stay open (vLLM guards /v1, /v2, /inference, /cohere only).
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert "vllm:" in httpx.get(f"{base}/metrics", timeout=10).text


def test_key_is_in_the_environment_not_on_a_command_line(keyed_engine):
    assert keyed_engine.proc is not None
    procs = tree(keyed_engine.proc.pid)
    assert len(procs) >= 2  # the launcher and vLLM's API server at least
    for proc in procs:
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert KEY not in cmdline, f"the key is on the command line of {proc.pid}: {cmdline[:200]}"
    # vLLM's API server holds it as VLLM_API_KEY (its environment is readable by the same user only).
    assert any(p.environ().get("VLLM_API_KEY") == KEY for p in procs if p.is_running())


def test_gateway_sends_the_key(keyed_engine, clips):
    path, text = clips[0]
    served = ServedApp(create_app(Settings(engines=f"audio={keyed_engine.base_url}", engine_api_key=KEY)))
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list()] == [keyed_engine.name]  # the probe's /v1/models
        result = client.audio.transcriptions.create(**transcription_kwargs(path, model=keyed_engine.name))
        assert speech.word_error_rate([text], [result.text]) < WER_LIMIT
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    finally:
        served.stop()


def test_gateway_without_the_key_sees_the_engine_down(keyed_engine):
    served = ServedApp(create_app(Settings(engines=f"audio={keyed_engine.base_url}")))
    try:
        # Its /v1/models probe is refused: the engine is down, and the reason is said.
        r = httpx.get(f"{served.url}/v1/models", timeout=60)
        assert r.status_code == 503 and "401" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 503
    finally:
        served.stop()


def test_health_probe_sends_the_key(keyed_engine):
    port = keyed_engine.port
    headers = health.engine_headers(Settings(engine_api_key=KEY))
    verdict, _ = health.progress_check("audio", port, 10, 60, None, headers)
    assert verdict.startswith("ok (1-token probe")
    with pytest.raises(health.Unhealthy, match="401"):
        health.progress_check("audio", port, 10, 60, None)
