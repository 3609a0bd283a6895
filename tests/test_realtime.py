"""Realtime transcription (/v1/realtime) without a vLLM engine: the wire (GA and beta, with the unmodified openai
SDK and raw WebSockets), hostile clients, limits, and the pieces (resampler, streaming VAD, turns, deltas) checked
against their whole-clip references. The gateway runs for real; behind it a small HTTP server answers
/v1/audio/transcriptions with one word per half second of the WAV it receives, and records what it got and which
requests were abandoned by their client. tests/test_realtime_real.py runs the same wire against real engines."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
import wave

import numpy as np
import openai
import pytest
import soundfile
import soxr
from fastapi import FastAPI, Request
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from mmcpu import vad
from mmcpu.config import Settings, get_settings
from mmcpu.gateway.app import create_app
from mmcpu.realtime import protocol as p
from mmcpu.realtime.audio import AudioError, Resampler, decode_pcm16, wav_bytes
from mmcpu.realtime.turns import Commit, InputBuffer, Pause, Resumed, Started, Stopped, StreamingVad
from mmcpu_dev import speech
from mmcpu_dev.payloads import pcm16_base64, realtime_beta_session, realtime_session
from mmcpu_dev.servers import ServedApp

MODEL = "stub-whisper"
WORD_S = 0.5  # the stub engine's text: one word per this much audio


@pytest.fixture(scope="module", autouse=True)
def silero_model() -> None:
    """The VAD's model where the gateway looks for it (`make models` fetches it; so does this, once)."""
    from mmcpu_dev.fixtures import silero_vad

    settings = get_settings()
    silero_vad.build(settings.models_dir / vad.MODEL_DIR, settings.cache_dir / "wheels")


# --- the stub engine --------------------------------------------------------------------------------------------
def stub_engine(delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    app.state.requests = []  # (fields, samples at 16 kHz)
    app.state.abandoned = 0
    app.state.active = 0

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/audio/transcriptions")
    async def transcribe(request: Request) -> dict:
        form = await request.form()
        with wave.open(io.BytesIO(await form["file"].read())) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
            samples = w.getnframes()
        app.state.requests.append(({k: v for k, v in form.items() if k != "file"}, samples))
        app.state.active += 1
        try:
            deadline = time.monotonic() + delay_s
            while time.monotonic() < deadline:  # as vLLM does, notice a client that went away (and stop)
                if await request.is_disconnected():
                    app.state.abandoned += 1
                    return {}
                await asyncio.sleep(0.02)
        finally:
            app.state.active -= 1
        seconds = samples / 16000
        words = " ".join(f"w{i}" for i in range(1, int(seconds / WORD_S) + 1))
        return {"text": f" {words}", "usage": {"type": "duration", "seconds": round(seconds, 3)}}

    return app


@pytest.fixture(scope="module")
def engine():
    served = ServedApp(stub_engine())
    yield served
    served.stop()


@pytest.fixture(scope="module")
def slow_engine():
    served = ServedApp(stub_engine(delay_s=30))
    yield served
    served.stop()


@contextlib.contextmanager
def gateway(engine_url: str, **settings):
    served = ServedApp(create_app(Settings(engines=f"stub={engine_url}", **settings)))
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def gw(engine):
    with gateway(engine.url, realtime_interim_s=0.2) as served:
        yield served


def ws_url(served: ServedApp, query: str = "intent=transcription") -> str:
    return f"ws://127.0.0.1:{served.port}/v1/realtime?{query}"


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)


def events_until(ws, kind: str, timeout: float = 20) -> list[dict]:
    out = []
    deadline = time.monotonic() + timeout
    while True:
        ev = json.loads(ws.recv(timeout=max(0.01, deadline - time.monotonic())))
        out.append(ev)
        if ev["type"] == kind:
            return out


def send(ws, kind: str, **fields) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def manual(ws, rate: int = 16000) -> None:
    send(ws, "session.update", session=realtime_session(MODEL, rate=rate, turn_detection=None))
    events_until(ws, "session.updated")


def hub_of(served: ServedApp):
    return served.app.state.realtime


def in_flight(served: ServedApp) -> dict[str, float]:
    """The gateway's own count of realtime engine requests in flight, as its /metrics shows it."""
    registry = served.app.state.metrics.registry
    return {k: registry.get_sample_value("mmcpu_realtime_engine_requests", {"kind": k}) for k in ("final", "interim")}


def wait_for(predicate, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- the pieces -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def talk(tmp_path_factory) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Three sentences with 1.2 s pauses (16 kHz) and where each is."""
    path, spans = speech.conversation(tmp_path_factory.mktemp("rt") / "talk.wav", speech.SENTENCES[:3], lead_s=1.0)
    audio, _ = soundfile.read(path, dtype="int16")
    return audio, spans


def random_chunks(audio: np.ndarray, seed: int, most: int = 6000):
    rng = np.random.default_rng(seed)
    i = 0
    while i < audio.size:
        n = int(rng.integers(1, most))
        yield audio[i : i + n]
        i += n


def test_streaming_vad_equals_whole_clip_vad(talk):
    """The VAD over random chunks gives every frame the probability the whole-clip VAD (the HTTP API's) gives it."""
    audio, _ = talk
    reference = vad.speech_probabilities(audio.astype(np.float32) / 32768)
    for seed in range(3):
        stream = StreamingVad(vad.session())
        probs = np.concatenate([stream.feed(c) for c in random_chunks(audio, seed)])
        assert probs.size == audio.size // vad.FRAME
        np.testing.assert_array_equal(probs, reference[: probs.size])


def test_resampler_same_samples_for_any_chunking(talk):
    """24 kHz -> 16 kHz: every chunking gives the samples of one resample of the whole stream (soxr's int16 output
    would not: it dithers)."""
    audio, _ = talk
    a24 = np.clip(np.rint(soxr.resample(audio.astype(np.float32) / 32768, 16000, 24000) * 32768), -32768, 32767).astype(
        np.int16
    )
    whole = soxr.resample(a24.astype(np.float32) / 32768, 24000, 16000, quality="HQ")
    whole = np.clip(np.rint(whole * 32768), -32768, 32767).astype(np.int16)
    for seed in range(3):
        r = Resampler(24000)
        out = np.concatenate([r(c) for c in random_chunks(a24, seed)])
        # The stream holds back its filter's last ~30 ms until more audio comes, or a commit flushes them.
        assert 0 < whole.size - out.size < 0.05 * 16000
        np.testing.assert_array_equal(np.concatenate([out, r.flush()]), whole)
    np.testing.assert_array_equal(Resampler(16000)(audio), audio)  # 16 kHz passes untouched
    with pytest.raises(AudioError):
        Resampler(8000)


def test_decode_pcm16_rejects_what_is_not_pcm16():
    samples = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    np.testing.assert_array_equal(decode_pcm16(pcm16_base64(samples)), samples)
    for bad in ("@@@", base64.b64encode(b"abc").decode(), 5, None):
        with pytest.raises(AudioError):
            decode_pcm16(bad)


def test_server_vad_turns_follow_the_pauses(talk):
    """One turn per sentence: it starts with prefix_padding_ms before the speech and is committed after
    silence_duration_ms of pause, holding the whole sentence; between turns only the padding is kept."""
    audio, spans = talk
    buf = InputBuffer(vad.session(), p.SERVER_VAD, 30 * 16000)
    events, pos = [], 0
    for chunk in random_chunks(audio, 7, 4000):
        for ev in buf.append(chunk):
            events.append((pos, ev))
        pos += chunk.size
        assert buf.samples <= 30 * 16000
        if not buf.speech:
            assert buf.samples <= 0.3 * 16000 + vad.FRAME
    kinds = [type(ev) for _, ev in events]
    assert kinds == [Started, Stopped, Commit] * len(spans)
    commits = [ev for _, ev in events if isinstance(ev, Commit)]
    starts = [ev.audio_start_ms for _, ev in events if isinstance(ev, Started)]
    ends = [ev.audio_end_ms for _, ev in events if isinstance(ev, Stopped)]
    for (a, b), start_ms, end_ms, commit in zip(spans, starts, ends, commits, strict=True):
        assert a / 16 - 300 - 32 - 100 <= start_ms <= a / 16  # Silero may fire a frame or two late
        assert b / 16 - 100 <= end_ms <= b / 16 + 300
        assert commit.reason == "vad"
        assert commit.audio.size / 16 >= (b - a) / 16 + 500  # the sentence and the pause that ended it


def test_server_vad_pause_is_seen_before_the_commit(talk):
    """In the pause after a sentence, before silence_duration_ms has passed, the open turn is `pausing` (no interim
    decode starts then); once the next sentence is under way it is not."""
    audio, spans = talk
    buf = InputBuffer(vad.session(), p.SERVER_VAD, 30 * 16000)
    (a0, b0), (a1, b1) = spans[:2]
    assert [type(ev) for ev in buf.append(audio[: b0 + 3200])] == [Started]  # 200 ms into the pause
    assert buf.speech and buf.pausing
    assert [type(ev) for ev in buf.append(audio[b0 + 3200 : a1 + (b1 - a1) // 2])] == [Stopped, Commit, Started]
    assert buf.speech and not buf.pausing


def test_server_vad_pause_announces_the_turns_audio_before_the_commit(talk):
    """With final_after_ms (200) under silence_duration_ms (500): 200 ms into each pause a Pause says where the
    turn's audio ends, and the commit then takes exactly that audio (the samples buffered at the Pause), so a
    decode started at the Pause is the turn's final."""
    audio, spans = talk
    buf = InputBuffer(vad.session(), p.SERVER_VAD, 30 * 16000, final_after_ms=200)
    events = []
    for chunk in random_chunks(audio, 3, 4000):
        for ev in buf.append(chunk):
            events.append((ev, buf.audio(ev.upto) if isinstance(ev, Pause) else None))
    assert [type(ev) for ev, _ in events] == [Started, Pause, Stopped, Commit] * len(spans)
    for i in range(len(spans)):
        (started, _), (pause, at_pause), (stopped, _), (commit, _) = events[4 * i : 4 * i + 4]
        np.testing.assert_array_equal(commit.audio, at_pause)
        # the turn's audio: from its start to 200 ms after the speech stopped
        assert commit.audio.size == (stopped.audio_end_ms - started.audio_start_ms + 200) * 16
        assert pause.upto == (stopped.audio_end_ms + 200) * 16
    # 0, or not under silence_duration_ms: no Pause, the whole pause in the turn (as before)
    for final_after_ms in (0, 500, 800):
        buf = InputBuffer(vad.session(), p.SERVER_VAD, 30 * 16000, final_after_ms=final_after_ms)
        assert [type(ev) for ev in buf.append(audio)] == [Started, Stopped, Commit] * len(spans)


def test_server_vad_speech_resuming_after_a_pause_withdraws_it(talk):
    """A pause longer than final_after_ms but shorter than silence_duration_ms: Pause, then Resumed when the
    speech goes on, one turn for both sentences, whose audio ends 200 ms into the final pause."""
    audio, spans = talk
    (a0, b0), (a1, b1) = spans[:2]
    quiet = np.zeros(int(0.33 * 16000), dtype=np.int16)  # a pause over 200 ms, under 500
    joined = np.concatenate([audio[:b0], quiet, audio[a1 : b1 + 16000]])
    buf = InputBuffer(vad.session(), p.SERVER_VAD, 30 * 16000, final_after_ms=200)
    events = [ev for chunk in random_chunks(joined, 4, 3000) for ev in buf.append(chunk)]
    assert [type(ev) for ev in events] == [Started, Pause, Resumed, Pause, Stopped, Commit]
    started, stopped, commit = events[0], events[4], events[5]
    assert commit.audio.size == (stopped.audio_end_ms - started.audio_start_ms + 200) * 16
    assert stopped.audio_end_ms * 16 > b0 + quiet.size  # the turn holds the second sentence


def test_server_vad_turn_is_cut_at_the_longest_turn(talk):
    """A turn longer than the longest turn (here 2 s) is committed there, and the speech goes on in a new turn."""
    audio, spans = talk
    a, b = spans[1]  # ~4.8 s of speech without a long pause
    buf = InputBuffer(vad.session(), p.SERVER_VAD, 2 * 16000)
    events = [ev for c in random_chunks(audio[: b + 16000], 5, 3000) for ev in buf.append(c)]
    full = [ev for ev in events if isinstance(ev, Commit) and ev.reason == "full"]
    assert len(full) >= 2 and all(c.audio.size == 2 * 16000 for c in full)
    kinds = [type(ev) for ev in events]
    assert kinds.count(Started) == kinds.count(Commit) == kinds.count(Stopped)  # every cut opens a new turn


def test_manual_buffer_is_committed_at_the_longest_turn(talk):
    audio, _ = talk
    buf = InputBuffer(vad.session(), None, 2 * 16000)
    commits = [ev for c in random_chunks(audio, 3) for ev in buf.append(c)]
    assert all(isinstance(c, Commit) and c.reason == "full" and c.audio.size == 32000 for c in commits)
    assert len(commits) == audio.size // 32000 and buf.samples == audio.size % 32000
    np.testing.assert_array_equal(np.concatenate([c.audio for c in commits] + [buf.take()]), audio)


def test_deltas_only_append():
    e = p.Emitted()
    assert e.extend(" The quick", hold_last=True) == "The"
    assert e.extend(" The quick brown fox", hold_last=True) == " quick brown"
    assert e.extend(" A quick brown fox jumps", hold_last=True) == ""  # changed an emitted word: nothing
    assert e.extend(" The quick brown fox jumps.", hold_last=False) == " fox jumps."
    assert e.words == ["The", "quick", "brown", "fox", "jumps."]


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"type": "realtime"}, "session.type"),
        ({"type": "transcription", "instructions": "x"}, "session.instructions"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}}, "session.audio.input.format.rate"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format.type"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": "x"}}}},
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        ({"audio": {"input": {"transcription": {"model": 5}}}}, "session.audio.input.transcription.model"),
        (
            {"audio": {"input": {"transcription": {"model": "m", "delay": "low"}}}},
            "session.audio.input.transcription.delay",
        ),
        ({"audio": {"output": {}}}, "session.audio.output"),
        ({"include": ["other"]}, "session.include"),
        ("text", "session"),
    ],
)
def test_ga_session_errors_name_the_parameter(session, param):
    with pytest.raises(p.ProtocolError) as info:
        p.apply_ga(p.Config(), session)
    assert info.value.param == param


def test_session_shapes():
    ga = p.apply_ga(
        p.Config(),
        realtime_session(
            "m",
            rate=16000,
            language="en",
            prompt="hi",
            turn_detection={"type": "server_vad", "silence_duration_ms": 700},
        ),
    )
    assert (ga.model, ga.language, ga.prompt, ga.rate) == ("m", "en", "hi", 16000)
    assert ga.turn_detection == vad.Options(0.5, 300, 700)
    assert p.apply_ga(ga, {"type": "transcription"}) == ga  # absent fields stay
    assert p.apply_ga(ga, {"audio": {"input": {"turn_detection": None}}}).turn_detection is None
    beta = p.apply_beta(p.Config(), realtime_beta_session("m", turn_detection=None))
    assert (beta.model, beta.rate, beta.turn_detection) == ("m", 24000, None)
    for bad, param in (
        ({"input_audio_format": "g711_ulaw"}, "session.input_audio_format"),
        ({"modalities": ["audio"]}, "session.modalities"),
    ):
        with pytest.raises(p.ProtocolError) as info:
            p.apply_beta(p.Config(), bad)
        assert info.value.param == param
    shown = p.session_object("s", ga, beta=False)
    assert shown["audio"]["input"]["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 700,
    }


# --- the wire, through the gateway --------------------------------------------------------------------------------
def test_ga_sdk_manual_turns(gw, engine):
    """The unmodified SDK's GA client: events in OpenAI's order and shapes, unique event ids, items chained, the
    engine given exactly the committed audio as a 16 kHz WAV, with the session's language and prompt."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    before = len(engine.app.state.requests)
    seen = []
    with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        first = conn.recv()
        assert first.type == "session.created" and first.session.type == "transcription"
        conn.session.update(
            session=realtime_session(MODEL, rate=24000, language="en", prompt="Hello.", turn_detection=None)
        )
        for seconds in (1.2, 2.0):
            for chunk in np.array_split(tone(seconds, 24000), 7):
                conn.input_audio_buffer.append(audio=pcm16_base64(chunk))
            conn.input_audio_buffer.commit()
        done = 0
        for ev in conn:
            seen.append(ev)
            done += ev.type == "conversation.item.done"
            if done == 2:
                break
    kinds = [e.type for e in seen]
    assert kinds[0] == "session.updated"
    assert len({e.event_id for e in [first, *seen]}) == len(seen) + 1
    committed = [e for e in seen if e.type == "input_audio_buffer.committed"]
    assert [c.previous_item_id for c in committed] == [None, committed[0].item_id]
    completed = [e for e in seen if e.type == "conversation.item.input_audio_transcription.completed"]
    assert [c.item_id for c in completed] == [c.item_id for c in committed]
    for c in completed:  # each item: committed -> added -> (deltas) -> completed -> done, in that order
        order = [
            e.type
            for e in seen
            if getattr(e, "item_id", None) == c.item_id or getattr(getattr(e, "item", None), "id", None) == c.item_id
        ]
        assert order[:2] == ["input_audio_buffer.committed", "conversation.item.added"], order
        assert order[-2:] == ["conversation.item.input_audio_transcription.completed", "conversation.item.done"]
        deltas = "".join(e.delta for e in seen if e.type.endswith("transcription.delta") and e.item_id == c.item_id)
        assert deltas.split() == c.transcript.split()
    assert [c.transcript for c in completed] == [" w1 w2", " w1 w2 w3 w4"]
    assert [c.usage.seconds for c in completed] == [pytest.approx(1.2, abs=0.01), pytest.approx(2.0, abs=0.01)]
    finals = engine.app.state.requests[before:]
    assert [f for f, _ in finals] == [
        {"model": MODEL, "response_format": "json", "language": "en", "prompt": "Hello."}
    ] * 2
    # 24 kHz in, 16 kHz to the engine (the resampler holds back a few samples of the stream's end)
    assert [round(n / 16000, 1) for _, n in finals] == [1.2, 2.0]


def test_beta_sdk_transcription_session(gw):
    """The SDK's beta client (?model=, OpenAI-Beta: realtime=v1): beta session events and item events."""
    client = openai.OpenAI(
        base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1"
    )
    with client.beta.realtime.connect(model=MODEL, extra_query={"intent": "transcription"}) as conn:
        created = conn.recv()
        assert created.type == "transcription_session.created"
        # (the SDK's beta union has no type for it: a plain dict)
        assert created.session["input_audio_transcription"]["model"] == MODEL  # from ?model=
        conn.transcription_session.update(session=realtime_beta_session(MODEL, turn_detection=None))
        conn.input_audio_buffer.append(audio=pcm16_base64(tone(1.0, 24000)))
        conn.input_audio_buffer.commit()
        kinds = []
        for ev in conn:
            kinds.append(ev.type)
            if ev.type == "conversation.item.input_audio_transcription.completed":
                assert ev.transcript == " w1 w2"
                break
    assert kinds[:3] == ["transcription_session.updated", "input_audio_buffer.committed", "conversation.item.created"]


def test_bad_events_get_errors_and_the_session_stays(engine):
    """Garbage of every kind: one `error` event each, in OpenAI's shape, naming the parameter; then the session
    still transcribes."""
    with gateway(engine.url, realtime_max_event_mb=0.05) as served:
        with connect(ws_url(served)) as ws:
            events_until(ws, "session.created")
            cases = [
                ("not json", None, "invalid_json"),
                ("[1, 2]", None, "invalid_event"),
                (json.dumps({"type": "response.create"}), "type", "invalid_value"),
                (json.dumps({"type": 7}), "type", "invalid_value"),
                (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "audio", "invalid_value"),
                (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}), "audio", "invalid_value"),
                (
                    json.dumps({"type": "input_audio_buffer.commit", "event_id": "mine"}),
                    None,
                    "input_audio_buffer_commit_empty",
                ),
                (
                    json.dumps(
                        {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcma"}}}}}
                    ),
                    "session.audio.input.format.type",
                    "unsupported_value",
                ),
                (
                    json.dumps(
                        {
                            "type": "session.update",
                            "session": {"audio": {"input": {"transcription": {"model": "no-such-model"}}}},
                        }
                    ),
                    "session.audio.input.transcription.model",
                    "model_not_found",
                ),
                (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 60_000}), None, "event_too_large"),
                (b"\x00\x01", None, "invalid_event"),
            ]
            for message, param, code in cases:
                ws.send(message)
                (ev,) = events_until(ws, "error")
                assert ev["error"]["param"] == param and ev["error"]["code"] == code, (message[:40], ev)
                assert ev["error"]["type"] and ev["error"]["message"]
                if code == "input_audio_buffer_commit_empty":
                    assert ev["error"]["event_id"] == "mine"
            manual(ws)
            send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(0.6)))
            send(ws, "input_audio_buffer.clear")
            events_until(ws, "input_audio_buffer.cleared")
            send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(1.0)))
            send(ws, "input_audio_buffer.commit")
            done = events_until(ws, "conversation.item.input_audio_transcription.completed")
            assert done[-1]["transcript"] == " w1 w2"  # the cleared audio is gone
        assert wait_for(lambda: hub_of(served).total == 0)


def test_manual_commit_during_server_vad(gw, engine, talk):
    """With server VAD on, a client's commit in the middle of speech ends the turn there (its item id kept); the
    rest of the speech opens a new turn."""
    audio, spans = talk
    a, b = spans[0]
    mid = (a + b) // 2
    with connect(ws_url(gw)) as ws:
        send(ws, "session.update", session=realtime_session(MODEL, rate=16000))
        events_until(ws, "session.updated")
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[:mid]))
        started = events_until(ws, "input_audio_buffer.speech_started")[-1]
        send(ws, "input_audio_buffer.commit")
        committed = events_until(ws, "input_audio_buffer.committed")[-1]
        assert committed["item_id"] == started["item_id"]
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[mid : b + 16000]))
        events = events_until(ws, "input_audio_buffer.committed")
        second = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
        assert second and events[-1]["item_id"] == second[0]["item_id"] != started["item_id"]
        assert events[-1]["previous_item_id"] == started["item_id"]


def test_deltas_while_the_turn_is_spoken(gw, talk):
    """Interim decodes of the open turn give deltas before it is committed (all but the last word heard); the
    final's delta completes them, and the deltas joined are the final text."""
    audio, spans = talk
    a, b = spans[1]
    with connect(ws_url(gw)) as ws:
        manual(ws)
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[: a + 32000]))  # 2 s into the speech
        first = events_until(ws, "conversation.item.input_audio_transcription.delta")[-1]
        assert first["delta"].split()[0] == "w1"
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[a + 32000 : b]))
        send(ws, "input_audio_buffer.commit")
        events = [first, *events_until(ws, "conversation.item.input_audio_transcription.completed")]
        kinds = [e["type"] for e in events]
        assert kinds.index("input_audio_buffer.committed") > 0  # the first delta came before the commit
        deltas = "".join(e["delta"] for e in events if e["type"].endswith(".delta"))
        assert deltas.split() == events[-1]["transcript"].split()


def test_no_model_fails_the_turn_not_the_session(gw):
    with connect(ws_url(gw)) as ws:
        send(ws, "session.update", session=realtime_session(None, rate=16000, turn_detection=None))
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(0.5)))
        send(ws, "input_audio_buffer.commit")
        failed = events_until(ws, "conversation.item.input_audio_transcription.failed")[-1]
        assert failed["error"]["code"] == "model_required"
        manual(ws)
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(0.5)))
        send(ws, "input_audio_buffer.commit")
        assert events_until(ws, "conversation.item.input_audio_transcription.completed")[-1]["transcript"] == " w1"


def test_keys_header_and_browser_subprotocol(engine):
    with gateway(engine.url, api_key="sekrit") as served:
        for headers, protocols in (
            ({}, None),
            ({"Authorization": "Bearer wrong"}, None),
            ({}, ["realtime", "openai-insecure-api-key.wrong"]),
        ):
            with pytest.raises(InvalidStatus) as info:
                connect(ws_url(served), additional_headers=headers, subprotocols=protocols)
            assert info.value.response.status_code == 401
            assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"
        with connect(ws_url(served), additional_headers={"Authorization": "Bearer sekrit"}) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        with connect(ws_url(served), subprotocols=["realtime", "openai-insecure-api-key.sekrit"]) as ws:
            assert ws.subprotocol == "realtime"  # echoed, as a browser requires; the key never is
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        with pytest.raises(InvalidStatus) as info:
            connect(ws_url(served, "intent=conversation"), additional_headers={"Authorization": "Bearer sekrit"})
        assert info.value.response.status_code == 400


def test_session_limits(engine):
    """Past MMCPU_REALTIME_MAX_SESSIONS a connection is told and closed; past MMCPU_REALTIME_SESSIONS_PER_ENGINE a
    session cannot take the engine's model but stays open; closing frees both."""
    with gateway(engine.url, realtime_max_sessions=2, realtime_sessions_per_engine=1) as served:
        with connect(ws_url(served, f"intent=transcription&model={MODEL}")) as a, connect(ws_url(served)) as b:
            events_until(a, "session.created")
            events_until(b, "session.created")
            with connect(ws_url(served)) as c:
                ev = json.loads(c.recv(timeout=10))
                assert ev["type"] == "error" and ev["error"]["code"] == "session_limit_reached"
                with pytest.raises(ConnectionClosed) as info:
                    c.recv(timeout=10)
                assert info.value.rcvd.code == 1013
            send(b, "session.update", session=realtime_session(MODEL))
            ev = events_until(b, "error")[-1]["error"]
            assert ev["code"] == "session_limit_reached" and ev["param"] == "session.audio.input.transcription.model"
            assert hub_of(served).per_engine["stub"] == 1
        assert wait_for(lambda: hub_of(served).total == 0 and hub_of(served).per_engine["stub"] == 0)
        with connect(ws_url(served)) as b:
            send(b, "session.update", session=realtime_session(MODEL))
            assert events_until(b, "session.updated")


def test_idle_session_is_closed(engine):
    with gateway(engine.url, realtime_idle_s=1) as served:
        with connect(ws_url(served)) as ws:
            events_until(ws, "session.created")
            t0 = time.monotonic()
            ev = events_until(ws, "error", timeout=10)[-1]
            assert ev["error"]["code"] == "idle_timeout" and time.monotonic() - t0 < 5
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        assert wait_for(lambda: hub_of(served).total == 0)


def test_gone_client_leaves_no_engine_work(slow_engine, talk):
    """A commit cancels the open turn's interim decode at the engine; a client that then disconnects while its turn
    is at the engine: that request is abandoned too (the engine sees its client go), and the session is gone."""
    state = slow_engine.app.state
    abandoned = state.abandoned
    audio, spans = talk
    with gateway(slow_engine.url, realtime_interim_s=0.2) as served:
        ws = connect(ws_url(served))
        manual(ws)
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[: spans[0][1]]))
        assert wait_for(lambda: state.active == 1, timeout=2)  # the interim decode of the open turn
        send(ws, "input_audio_buffer.commit")
        assert wait_for(lambda: state.abandoned - abandoned == 1 and state.active == 1, timeout=2)  # now the final
        t0 = time.monotonic()
        ws.close()
        assert wait_for(lambda: state.active == 0, timeout=5)
        assert time.monotonic() - t0 < 2 and state.abandoned - abandoned == 2
        assert wait_for(lambda: hub_of(served).total == 0)
        assert in_flight(served) == {"final": 0, "interim": 0}


def test_server_vad_final_starts_in_the_pause_and_is_the_turns(engine, talk):
    """Server VAD, no interim decodes: one engine request per turn, over exactly the turn's audio (its start to
    200 ms after its speech stopped), sent before the turn is committed, and its answer is the turn's `completed`."""
    state = engine.app.state
    audio, spans = talk
    with gateway(engine.url, realtime_interim_s=0) as served, connect(ws_url(served)) as ws:
        send(ws, "session.update", session=realtime_session(MODEL, rate=16000))
        events_until(ws, "session.updated")
        before = len(state.requests)
        a, b = spans[0]
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[: b + 4000]))  # 250 ms into the pause
        assert wait_for(lambda: len(state.requests) == before + 1, timeout=3)  # the final, not yet committed
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[b + 4000 : spans[1][0]]))
        events = events_until(ws, "conversation.item.input_audio_transcription.completed")
        assert len(state.requests) == before + 1  # the commit sent nothing more
        started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
        stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
        samples = (stopped["audio_end_ms"] + 200 - started["audio_start_ms"]) * 16
        assert state.requests[-1][1] == samples
        assert events[-1]["usage"]["seconds"] == round(samples / 16000, 3)


def test_server_vad_speech_resuming_cancels_the_early_final(slow_engine, talk):
    """Speech that resumes after a short pause (over 200 ms, under silence_duration_ms): the final decode started
    in the pause is abandoned at the engine, and the turn goes on."""
    state = slow_engine.app.state
    abandoned = state.abandoned
    audio, spans = talk
    (a0, b0), (a1, b1) = spans[:2]
    with gateway(slow_engine.url, realtime_interim_s=0) as served, connect(ws_url(served)) as ws:
        send(ws, "session.update", session=realtime_session(MODEL, rate=16000))
        events_until(ws, "session.updated")
        quiet = np.zeros(int(0.33 * 16000), dtype=np.int16)
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(np.concatenate([audio[:b0], quiet])))
        assert wait_for(lambda: state.active == 1, timeout=3)  # the early final, at the engine
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[a1 : (a1 + b1) // 2]))
        assert wait_for(lambda: state.active == 0 and state.abandoned - abandoned == 1, timeout=3)
        assert in_flight(served)["final"] == 0


def test_interim_decodes_share_the_engine_slots(slow_engine, talk):
    """Two sessions speaking at once with one interim slot per engine: one interim decode at the engine, never two;
    the slot is freed when its session ends."""
    state = slow_engine.app.state
    audio, spans = talk
    with gateway(slow_engine.url, realtime_interim_s=0.2, realtime_interims_per_engine=1) as served:
        with connect(ws_url(served)) as a, connect(ws_url(served)) as b:
            for ws in (a, b):
                manual(ws)
                send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[: spans[0][1]]))
            assert wait_for(lambda: state.active == 1, timeout=3)
            assert not wait_for(lambda: state.active > 1, timeout=1.5)
        assert wait_for(lambda: state.active == 0 and hub_of(served).interims["stub"] == 0)


def test_waiting_for_a_transcript_is_not_idle(talk):
    """A client that commits and then only waits: its session outlives MMCPU_REALTIME_IDLE_S while the engine works
    on the turn, delivers the transcript, and is closed for idleness only that long after it."""
    engine = ServedApp(stub_engine(delay_s=3))
    try:
        with gateway(engine.url, realtime_idle_s=1) as served, connect(ws_url(served)) as ws:
            manual(ws)
            send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(1.0)))
            send(ws, "input_audio_buffer.commit")
            t0 = time.monotonic()
            events = events_until(ws, "error", timeout=15)
            kinds = [e["type"] for e in events]
            assert "conversation.item.input_audio_transcription.completed" in kinds
            assert events[-1]["error"]["code"] == "idle_timeout" and 3 + 0.9 < time.monotonic() - t0 < 3 + 3
    finally:
        engine.stop()


def test_stalled_client_leaves_no_engine_work(slow_engine, talk):
    """A client that stops sending in the middle of a turn: after MMCPU_REALTIME_IDLE_S its interim decode is
    abandoned at the engine and the session closed. (A session whose committed turn is still at the engine is not
    idle: its client may be waiting for the transcript.)"""
    state = slow_engine.app.state
    abandoned = state.abandoned
    audio, spans = talk
    with gateway(slow_engine.url, realtime_idle_s=2, realtime_interim_s=0.2) as served:
        with connect(ws_url(served)) as ws:
            manual(ws)
            send(ws, "input_audio_buffer.append", audio=pcm16_base64(audio[: spans[0][1] // 2]))
            assert wait_for(lambda: state.active == 1, timeout=2)
            t0 = time.monotonic()
            assert events_until(ws, "error", timeout=10)[-1]["error"]["code"] == "idle_timeout"
            assert wait_for(lambda: state.active == 0 and hub_of(served).total == 0, timeout=3)
            assert time.monotonic() - t0 < 5 and state.abandoned - abandoned == 1


def _raw_client(port: int):
    """A WebSocket client on a bare socket that never reads what the server sends."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(b"0123456789abcdef").decode()
    sock.sendall(
        (
            f"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    assert b" 101 " in sock.recv(1024)

    def frame(text: bytes) -> bytes:  # one masked text frame (mask 0: the payload as is)
        return bytes([0x81, 0x80 | len(text)]) + b"\0\0\0\0" + text

    return sock, frame


def test_client_that_does_not_read_is_dropped(engine):
    """A flood of bad events whose errors are never read: the session is closed, not left to grow: by its unsent
    events piling up (MMCPU_REALTIME_SEND_TIMEOUT_S or the outbox bound) or, once the server's own reads stall
    behind the unread replies, by the idle timeout."""
    with gateway(engine.url, realtime_send_timeout_s=2, realtime_idle_s=3) as served:
        sock, frame = _raw_client(served.port)
        assert wait_for(lambda: hub_of(served).total == 1)
        deadline = time.monotonic() + 30
        sent = 0
        with contextlib.suppress(OSError):
            while hub_of(served).total and time.monotonic() < deadline:
                sock.sendall(frame(b"x" * 100) * 50)
                sent += 50
        assert wait_for(lambda: hub_of(served).total == 0, timeout=15), sent
        sock.close()


def test_longest_turn_is_committed_without_a_commit(engine):
    with gateway(engine.url, realtime_buffer_s=2) as served:
        with connect(ws_url(served)) as ws:
            manual(ws, rate=16000)
            for chunk in np.array_split(tone(5.0), 9):
                send(ws, "input_audio_buffer.append", audio=pcm16_base64(chunk))
            send(ws, "input_audio_buffer.commit")
            done = []
            while len(done) < 3:
                done += [
                    e
                    for e in events_until(ws, "conversation.item.input_audio_transcription.completed")
                    if e["type"].endswith("completed")
                ]
            assert [e["usage"]["seconds"] for e in done] == [2.0, 2.0, 1.0]


def test_browser_page_is_served(gw):
    import httpx

    r = httpx.get(f"{gw.url}/realtime", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "/v1/realtime?intent=transcription" in r.text and "openai-insecure-api-key." in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]


def test_wav_is_what_a_client_uploads():
    samples = tone(0.25)
    data, rate = soundfile.read(io.BytesIO(wav_bytes(samples)), dtype="int16")
    assert rate == 16000
    np.testing.assert_array_equal(data, samples)


def test_bench_keeps_up_only_when_every_turn_is_in_time():
    """The realtime bench's arithmetic (mmcpu_dev.bench.realtime.summarize) on made-up runs: a session keeps up
    when all its turns are completed within the bound after their speech ended; failed sessions are counted."""
    from mmcpu_dev.bench.realtime import summarize
    from mmcpu_dev.realtime import Item, Run

    spans = [(16000, 48000), (64000, 96000)]  # speech at 1-3 s and 4-6 s

    def run(done_after: list[float], delta_after: float | None = None) -> Run:
        r = Run(t0=100.0, sent_until=107.0)
        for i, ((a, b), late) in enumerate(zip(spans, done_after, strict=False)):
            first = None if delta_after is None else 100 + a / 16000 + delta_after
            r.items[f"i{i}"] = Item(f"i{i}", completed=100 + b / 16000 + late, transcript=f" t{i}", first_delta=first)
        return r

    out = summarize([run([0.5, 0.7], 1.2), run([0.4, 2.5]), TimeoutError()], spans, keep_up_s=2.0, clip_s=7.0)
    assert out["sessions"] == 3 and out["kept_up"] == 1 and out["failed_sessions"] == ["TimeoutError()"]
    assert out["end_to_completed_s"]["max"] == pytest.approx(2.5)
    assert sorted(out["texts"]) == ["t0 t1", "t0 t1"] and out["client_send_lag_s"] == pytest.approx(0)
    # without an interim delta the first delta is the final's: 1.2 and 1.2 (interim), 2.4 and 4.5 (the finals')
    assert out["first_delta_s"]["p50"] == pytest.approx((1.2 + 2.4) / 2)


def test_session_keeps_reading_while_its_turns_wait(slow_engine, monkeypatch):
    """Committed turns waiting for a busy engine never stop the session reading its client (an unread WebSocket
    does not take the client's keepalive pongs either, and the session would die of a ping timeout): with more
    turns waiting than the engine takes, a session update is still answered at once. A session whose backlog passes
    the bound is told so (`engine_overloaded`) and closed; its turns leave the engine."""
    from mmcpu.realtime import session as rt_session

    state = slow_engine.app.state
    monkeypatch.setattr(rt_session, "BACKLOG_S", 7)
    with gateway(slow_engine.url, realtime_interim_s=0) as served, connect(ws_url(served)) as ws:
        manual(ws)
        for _ in range(6):  # 6 s of turns: one at the engine, five waiting
            send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(1.0)))
            send(ws, "input_audio_buffer.commit")
        t0 = time.monotonic()
        send(ws, "session.update", session=realtime_session(MODEL, rate=16000, turn_detection=None))
        kinds = [e["type"] for e in events_until(ws, "session.updated", timeout=5)]
        assert time.monotonic() - t0 < 2 and kinds.count("input_audio_buffer.committed") == 6
        assert wait_for(lambda: state.active == 1) and hub_of(served).finals["stub"] == 6
        send(ws, "input_audio_buffer.append", audio=pcm16_base64(tone(2.0)))
        send(ws, "input_audio_buffer.commit")  # 8 s waiting: over the bound
        assert events_until(ws, "error", timeout=5)[-1]["error"]["code"] == "engine_overloaded"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
        assert wait_for(lambda: state.active == 0 and hub_of(served).total == 0, timeout=5)
        assert hub_of(served).finals["stub"] == 0


def test_finals_first_across_sessions(slow_engine, talk):
    """While one session's committed turn is at the engine, no other session of that engine starts an interim
    decode: the finals go first."""
    state = slow_engine.app.state
    audio, spans = talk
    with gateway(slow_engine.url, realtime_interim_s=0.2) as served:
        with connect(ws_url(served)) as a, connect(ws_url(served)) as b:
            manual(a)
            manual(b)
            send(a, "input_audio_buffer.append", audio=pcm16_base64(tone(1.0)))
            send(a, "input_audio_buffer.commit")
            assert wait_for(lambda: state.active == 1, timeout=3)  # a's final
            send(b, "input_audio_buffer.append", audio=pcm16_base64(audio[: spans[0][1]]))
            assert not wait_for(lambda: state.active > 1, timeout=1.5)  # no interim for b
        assert wait_for(lambda: state.active == 0 and hub_of(served).total == 0, timeout=5)
        assert hub_of(served).finals["stub"] == 0 and hub_of(served).interims["stub"] == 0
