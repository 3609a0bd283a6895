"""Streamed transcriptions on a real MRV2 engine (Whisper tiny.en) in OpenAI's event format (mmcpu/stt): the
unmodified ``openai`` Python client's typed iterator, OpenAI's official Node SDK (npm ``openai``, pinned below) with
node, the raw server-sent events, and the gateway relaying them byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent

from mmcpu.config import Settings, get_settings
from mmcpu.gateway.app import create_app
from mmcpu_dev import speech
from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.payloads import audio_form, transcription_kwargs
from mmcpu_dev.servers import ServedApp

pytestmark = pytest.mark.slow

# The last 6.x: the 7.x releases declare node >= 22 (package.json "engines"), the project's node is 20.
NODE_OPENAI = "6.30.1"
NODE_SCRIPT = Path(__file__).parent / "sdk" / "stream.mjs"
EVENT_TYPES = {"transcript.text.delta", "transcript.text.done"}


def _stream(engine, clip: Path, **fields):
    kwargs = transcription_kwargs(clip, model=engine.name, stream=True, **fields)
    return list(engine.client().audio.transcriptions.create(**kwargs))


def _sse(base_url: str, data: dict[str, str], files: dict, path: str = "/v1/audio/transcriptions") -> list[str]:
    """The ``data:`` payloads of a streamed answer, as sent."""
    with httpx.stream("POST", f"{base_url}{path}", data=data, files=files, timeout=300) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def _check_events(payloads: list[str]) -> tuple[list[dict], dict]:
    """OpenAI's stream: deltas, one done event last, then [DONE] (both SDKs stop there); (deltas, done)."""
    assert payloads[-1] == "[DONE]", payloads[-3:]
    events = [json.loads(p) for p in payloads[:-1]]
    assert all(e["type"] in EVENT_TYPES for e in events), events
    *deltas, done = events
    assert done["type"] == "transcript.text.done" and all(d["type"] == "transcript.text.delta" for d in deltas)
    return deltas, done


@pytest.mark.parametrize("index", [0, 1])
def test_typed_stream_equals_non_streamed(whisper_engine, clips, index):
    """Greedy: the deltas joined are the done event's text, which is the non-streamed answer's; usage in tokens."""
    clip, reference = clips[index]
    events = _stream(whisper_engine, clip)
    *deltas, done = events
    print(f"\n{len(deltas)} deltas: {[d.delta for d in deltas]}\ndone: {done.model_dump(exclude_none=True)}")
    assert all(isinstance(d, TranscriptionTextDeltaEvent) and d.type == "transcript.text.delta" for d in deltas)
    assert isinstance(done, TranscriptionTextDoneEvent) and done.type == "transcript.text.done"
    assert len(deltas) > 1 and all(d.delta for d in deltas), "one piece (or empty ones) is not a stream"
    assert "".join(d.delta for d in deltas) == done.text
    plain = whisper_engine.client().audio.transcriptions.create(**transcription_kwargs(clip, model=whisper_engine.name))
    assert done.text == plain.text
    assert speech.word_error_rate([reference], [done.text]) < WER_LIMIT
    usage = done.usage
    assert usage is not None and usage.type == "tokens"
    assert usage.output_tokens >= len(deltas) and usage.total_tokens == usage.input_tokens + usage.output_tokens
    details = usage.input_token_details
    assert details.audio_tokens > 0 and details.text_tokens > 0
    assert usage.input_tokens == details.audio_tokens + details.text_tokens


def test_stream_at_openai_default_temperature(whisper_engine, clips):
    """No temperature sent (OpenAI's default, sampling): a stream of events all the same, and, seeded, the very text
    the non-streamed request samples (sampled text can be far from the reference: no WER bound)."""
    clip, _ = clips[2]
    kwargs = transcription_kwargs(clip, model=whisper_engine.name, temperature=None)
    assert "temperature" not in kwargs
    client = whisper_engine.client()
    *deltas, done = list(client.audio.transcriptions.create(**kwargs, stream=True, extra_body={"seed": 7}))
    assert isinstance(done, TranscriptionTextDoneEvent) and done.usage is not None
    assert deltas and all(isinstance(d, TranscriptionTextDeltaEvent) for d in deltas)
    assert "".join(d.delta for d in deltas) == done.text and done.text.strip()
    assert done.text == client.audio.transcriptions.create(**kwargs, extra_body={"seed": 7}).text


def test_text_format_streams_the_same_events(whisper_engine, clips):
    """response_format=text may stream (vLLM did): the same events and text as json."""
    clip, _ = clips[0]
    as_json = _stream(whisper_engine, clip)
    as_text = _stream(whisper_engine, clip, response_format="text")
    assert [e.model_dump() for e in as_text] == [e.model_dump() for e in as_json]


def test_raw_events_and_continuous_usage(whisper_engine, clips):
    """On the wire: no chat-style chunk fields; vLLM's stream options add the running usage to each delta."""
    clip, _ = clips[1]
    data, files = audio_form(transcription_kwargs(clip, model=whisper_engine.name, stream=True))
    deltas, done = _check_events(_sse(whisper_engine.base_url, data, files))
    assert all(set(d) == {"type", "delta"} for d in deltas), deltas[:3]
    assert set(done) == {"type", "text", "usage"}

    options = {"stream_include_usage": "true", "stream_continuous_usage_stats": "true"}
    counted, counted_done = _check_events(_sse(whisper_engine.base_url, {**data, **options}, files))
    assert [d["delta"] for d in counted] == [d["delta"] for d in deltas] and counted_done == done
    outputs = [d["usage"]["output_tokens"] for d in counted]
    assert outputs == sorted(outputs) and outputs[-1] <= done["usage"]["output_tokens"], outputs
    assert {d["usage"]["input_tokens"] for d in counted} == {done["usage"]["input_tokens"]}


def test_gateway_relays_events_unchanged(whisper_engine, clips):
    """The gateway passes the engine's events on as they are (greedy, so the same bytes both ways)."""
    clip, _ = clips[0]
    data, files = audio_form(transcription_kwargs(clip, model=whisper_engine.name, stream=True))
    gateway = ServedApp(create_app(Settings(engines=f"audio={whisper_engine.base_url}")))
    try:
        relayed = _sse(gateway.url, data, files)
    finally:
        gateway.stop()
    assert relayed == _sse(whisper_engine.base_url, data, files)
    _check_events(relayed)


@pytest.fixture(scope="session")
def node_openai() -> Path:
    """node_modules holding OpenAI's Node SDK at NODE_OPENAI, installed once into the cache with npm; no node or
    npm, or a failed install, fails the test with the reason (never a skip)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, f"OpenAI's Node SDK test needs node and npm on PATH (node: {node}, npm: {npm})"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert int(version.lstrip("v").split(".")[0]) >= 20, f"node {version}: the SDK needs node >= 20"
    prefix = get_settings().cache_dir / "npm" / f"openai-{NODE_OPENAI}"
    modules = prefix / "node_modules"
    package = modules / "openai" / "package.json"
    if not package.is_file() or json.loads(package.read_text())["version"] != NODE_OPENAI:
        # --legacy-peer-deps: the SDK's peers (ws, zod) are for realtime and helpers, not needed here.
        result = subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(prefix),
                "--no-save",
                "--no-package-lock",
                "--no-audit",
                "--no-fund",
                "--legacy-peer-deps",
                f"openai@{NODE_OPENAI}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"npm install openai@{NODE_OPENAI} failed:\n{result.stdout}{result.stderr}"
    assert json.loads(package.read_text())["version"] == NODE_OPENAI
    return modules


@pytest.mark.parametrize("temperature", ["0", None], ids=["greedy", "default-temperature"])
def test_node_sdk_for_await_reads_event_types(whisper_engine, clips, node_openai, temperature):
    clip, reference = clips[0]
    args = ["node", str(NODE_SCRIPT), f"{whisper_engine.base_url}/v1", whisper_engine.name, str(clip)]
    result = subprocess.run(
        [*args, *([temperature] if temperature else [])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OPENAI_NODE_MODULES": str(node_openai)},
    )
    print(f"\n{result.stdout}{result.stderr}")
    assert result.returncode == 0, result.stderr
    *events, end = [json.loads(line) for line in result.stdout.splitlines()]
    end = end["end"]
    assert end["sdk"] == NODE_OPENAI
    assert [e["type"] for e in events] == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"]
    assert len(events) > 2 and end["deltas"] == end["done_text"] == events[-1]["text"]
    usage = events[-1]["usage"]
    assert usage["type"] == "tokens" and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert end["done_text"].strip()
    if temperature == "0":
        assert speech.word_error_rate([reference], [end["done_text"]]) < WER_LIMIT
        plain = whisper_engine.client().audio.transcriptions.create(
            **transcription_kwargs(clip, model=whisper_engine.name)
        )
        assert end["done_text"] == plain.text
