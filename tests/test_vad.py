"""Voice-activity chunking (``chunking_strategy``, mmcpu/vad.py, served by mmcpu/stt).

Unit: the request field's parsing and OpenAI's ranges; speech spans, windows and the time map on synthetic
probabilities and signals; Silero's probabilities against faster-whisper's own driver (bench venv); how
MMCPU_VAD_DEFAULT reaches the serving code. Real server (the session's tiny.en engine, MRV2): a ~2-minute clip
that is half silence is encoded in fewer windows with the words kept and its segment times inside its speech;
silence and noise give an empty text in every response format; a ``server_vad`` object is accepted in both
forms clients send it.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import numpy as np
import pytest

from mmcpu import vad
from mmcpu_dev import payloads, speech
from mmcpu_dev.bench import vad as clips

SR = vad.SAMPLE_RATE


# --- the request field ----------------------------------------------------------------------------------------
def test_auto_and_unset():
    assert vad.parse_strategy("auto") is vad.AUTO
    assert vad.parse_strategy(None) is None
    assert vad.request_strategy({}, None) is None
    assert vad.request_strategy({"other": "x"}, vad.AUTO) is vad.AUTO  # the default applies when unset


def test_server_vad_forms():
    expected = vad.Options(threshold=0.6, pad_ms=100, min_silence_ms=700)
    obj = {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 100, "silence_duration_ms": 700}
    assert vad.parse_strategy(obj) == expected
    assert vad.parse_strategy(json.dumps(obj)) == expected
    # OpenAI's SDKs send an object in a multipart form as chunking_strategy[field]=text
    form = {f"chunking_strategy[{k}]": str(v) for k, v in obj.items()}
    assert vad.request_strategy(form, None) == expected
    # OpenAI's defaults for the fields left out
    assert vad.parse_strategy({"type": "server_vad"}) == vad.Options(0.5, 300, 200)


@pytest.mark.parametrize(
    "value",
    [
        "fixed",
        "",
        "42",
        "[1]",
        "{not json",
        {"type": "client_vad"},
        {"threshold": 0.5},
        {"type": "server_vad", "x": 1},
        {"type": "server_vad", "threshold": 1.5},
        {"type": "server_vad", "threshold": -0.1},
        {"type": "server_vad", "threshold": "loud"},
        {"type": "server_vad", "threshold": float("nan")},
        {"type": "server_vad", "prefix_padding_ms": -1},
        {"type": "server_vad", "silence_duration_ms": -200},
        {"type": "server_vad", "silence_duration_ms": 2.5},
        {"type": "server_vad", "prefix_padding_ms": True},
        ["auto"],
        7,
    ],
)
def test_malformed_strategies(value):
    with pytest.raises(vad.StrategyError):
        vad.parse_strategy(value)


def test_value_and_fields_together_refused():
    with pytest.raises(vad.StrategyError):
        vad.request_strategy({"chunking_strategy": "auto", "chunking_strategy[type]": "server_vad"}, None)


def test_default_from_setting(monkeypatch):
    """MMCPU_VAD_DEFAULT reaches the serving code through default_strategy(served names), which the patched
    serving calls once at start in vLLM's API server (the launcher passes its environment on)."""
    from mmcpu.config import get_settings

    for value, names, expected in [
        ("", ["whisper-tiny.en"], None),
        ("whisper-base", ["whisper-tiny.en"], None),
        ("whisper-base, whisper-tiny.en", ["whisper-tiny.en"], vad.AUTO),
        ("*", ["any"], vad.AUTO),
    ]:
        monkeypatch.setenv("MMCPU_VAD_DEFAULT", value)
        get_settings.cache_clear()
        assert vad.default_strategy(names) == expected, value
    get_settings.cache_clear()


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(vad.VadUnavailable, match="silero_vad_v6.onnx.*mmcpu_dev.fixtures silero-vad"):
        vad.load(tmp_path / "silero-vad" / vad.MODEL_FILE)


# --- spans, windows, the time map -----------------------------------------------------------------------------
def probs_for(pattern: list[tuple[float, float]]) -> tuple[np.ndarray, int]:
    """Per-frame probabilities from (seconds, probability) runs."""
    frames = [np.full(int(round(s * SR / vad.FRAME)), p) for s, p in pattern]
    probs = np.concatenate(frames)
    return probs, probs.size * vad.FRAME


def test_spans_follow_speech_and_pad():
    probs, n = probs_for([(2.0, 0.0), (3.0, 0.9), (5.0, 0.0), (2.0, 0.9), (1.0, 0.0)])
    opts = vad.Options(threshold=0.5, pad_ms=200, min_silence_ms=500)
    spans = vad.speech_spans(probs, n, opts)
    assert len(spans) == 2
    (a0, b0), (a1, b1) = (tuple(x / SR for x in s) for s in spans)
    assert a0 == pytest.approx(2.0 - 0.2, abs=0.04) and b0 == pytest.approx(5.0 + 0.2, abs=0.04)
    assert a1 == pytest.approx(10.0 - 0.2, abs=0.04) and b1 == pytest.approx(12.0 + 0.2, abs=0.04)


def test_short_pause_does_not_split():
    probs, n = probs_for([(1.0, 0.0), (2.0, 0.9), (0.3, 0.1), (2.0, 0.9), (1.0, 0.0)])
    assert len(vad.speech_spans(probs, n, vad.Options(min_silence_ms=500))) == 1
    assert len(vad.speech_spans(probs, n, vad.Options(min_silence_ms=100, pad_ms=0))) == 2


def test_hysteresis_between_thresholds():
    # 0.4 is below threshold 0.5 but above neg_threshold 0.35: speech continues, never starts
    probs, n = probs_for([(1.0, 0.4), (1.0, 0.9), (2.0, 0.4), (3.0, 0.0)])
    [(a, b)] = vad.speech_spans(probs, n, vad.Options(pad_ms=0, min_silence_ms=500))
    assert a / SR == pytest.approx(1.0, abs=0.04) and b / SR == pytest.approx(4.0, abs=0.04)


def test_silence_has_no_span():
    probs, n = probs_for([(30.0, 0.05)])
    assert vad.speech_spans(probs, n, vad.AUTO) == []
    assert vad.windows([], 30 * SR) == []


def test_long_speech_is_split_at_its_last_pause():
    # 45 s of speech with a 0.2 s dip at 20 s: no span may exceed 30 s, the cut is at the dip
    probs, n = probs_for([(20.0, 0.9), (0.2, 0.0), (25.0, 0.9), (2.0, 0.0)])
    spans = vad.speech_spans(probs, n, vad.AUTO, max_span_s=30)
    assert len(spans) == 2 and all(b - a <= 30 * SR for a, b in spans)
    assert spans[0][1] / SR == pytest.approx(20.0, abs=0.5)


def test_windows_fewest_and_cut_at_longest_pause():
    s = SR
    # 4 spans of 10 s speech; pauses 1 s, 8 s, 2 s: two windows of 20 s, cut at the 8 s pause
    spans = [(0, 10 * s), (11 * s, 21 * s), (29 * s, 39 * s), (41 * s, 51 * s)]
    groups = vad.windows(spans, 30 * s)
    assert [len(g) for g in groups] == [2, 2]
    # greedy packing would put 3 spans of 9 s in the first window; the longest pause decides instead
    spans = [(0, 9 * s), (19 * s, 28 * s), (29 * s, 38 * s), (39 * s, 48 * s)]
    assert [len(g) for g in vad.windows(spans, 30 * s)] == [1, 3]
    for group in vad.windows(spans, 30 * s):
        assert sum(b - a for a, b in group) <= 30 * s


def test_time_map_through_removed_silence():
    s = SR
    m = vad.SpeechMap(
        windows=(((2 * s, 5 * s), (10 * s, 12 * s)), ((20 * s, 24 * s),)), sample_rate=SR, n_samples=30 * s
    )
    assert m.window_offsets() == [0.0, 5.0]
    assert m.to_original(0.0) == 2.0
    assert m.to_original(1.5) == 3.5
    assert m.to_original(3.0) == 10.0  # a start at the junction opens the later span
    assert m.to_original(3.0, is_end=True) == 5.0  # an end there closes the earlier one
    assert m.to_original(4.0) == 11.0
    assert m.to_original(5.0, window=1) == 20.0
    assert m.to_original(5.0, window=0, is_end=True) == 12.0
    assert m.to_original(7.5, window=1) == 22.5
    # Whisper's timestamps may run past a window's speech (its padding): held at the window's end
    assert m.to_original(29.0, window=0, is_end=True) == 12.0
    assert m.to_original(40.0, window=1, is_end=True) == 24.0


def test_plan_on_a_signal(tmp_path):
    """A tone burst is not speech for Silero; a real utterance is, and its plan keeps it whole and in place."""
    wav = speech.synthesize(speech.SENTENCES[0], tmp_path / "s.wav")
    voiced = clips.audio(wav)
    audio = np.concatenate(
        [np.zeros(3 * SR, np.float32), voiced, np.zeros(6 * SR, np.float32), voiced, np.zeros(2 * SR, np.float32)]
    )
    plan = vad.plan(audio, SR, vad.Options(pad_ms=200, min_silence_ms=1000), 30)
    assert len(plan.chunks) == 1 and len(plan.speech_map.spans) == 2
    assert plan.chunks[0].size == sum(b - a for a, b in plan.speech_map.spans)
    first, second = plan.speech_map.spans
    assert 2.5 < first[0] / SR < 3.6 and 3 + voiced.size / SR + 5 < second[0] / SR
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(5 * SR) / SR)).astype(np.float32)
    assert vad.plan(tone, SR, vad.AUTO, 30).chunks == []


def test_probabilities_match_faster_whisper(tmp_path, fw_reference):
    """Our driver of the ONNX file (frames, context, state) gives faster-whisper 1.2.1's own probabilities."""
    wav = speech.synthesize(speech.SENTENCES[1], tmp_path / "s.wav")
    ours = vad.speech_probabilities(clips.audio(wav))
    code = (
        "import sys, json, wave, numpy as np; from faster_whisper.vad import get_vad_model;"
        "w = wave.open(sys.argv[1]); a = np.frombuffer(w.readframes(w.getnframes()), '<i2') / 32768;"
        "a = np.pad(a.astype(np.float32), (0, -a.size % 512));"
        "print(json.dumps(get_vad_model()(a).reshape(-1).tolist()))"
    )
    out = subprocess.run(
        [str(fw_reference.BENCH_PYTHON), "-c", code, str(wav)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    theirs = np.array(json.loads(out), dtype=np.float32)
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


# --- real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vad_clips(tmp_path_factory):
    out = tmp_path_factory.mktemp("vad")
    path, text, spans = clips.pauses_clip(out)
    return {"pauses": (path, text, spans), "noise": clips.noise_clip(out), "silence": clips.silence_clip(out)}


def transcribe(engine, path, **kwargs):
    return engine.client().audio.transcriptions.create(
        model=engine.name, file=path.open("rb"), language="en", temperature=0, **kwargs
    )


@pytest.mark.slow
def test_half_silence_fewer_windows_words_kept(whisper_engine, vad_clips):
    path, text, truth = vad_clips["pauses"]
    duration = clips.audio(path).size / SR
    runs = {}
    for strategy in (None, "auto"):
        before = clips.finished_requests(whisper_engine.base_url)
        extra = {} if strategy is None else {"chunking_strategy": strategy}
        answer = transcribe(whisper_engine, path, response_format="verbose_json", **extra)
        # verbose_json: one decode a window, timed by an alignment forward (a worker call, not a request)
        runs[strategy] = (answer, clips.finished_requests(whisper_engine.base_url) - before)
    (fixed, fixed_windows), (auto, auto_windows) = runs[None], runs["auto"]
    plan = vad.plan(clips.audio(path), SR, vad.AUTO, 30)
    # fixed 30 s windows over the whole clip vs windows of speech only, as planned in-process
    assert fixed_windows >= np.ceil(duration / 30)
    assert auto_windows == len(plan.chunks) < fixed_windows
    wer_fixed = speech.word_error_rate([text], [fixed.text])
    wer_auto = speech.word_error_rate([text], [auto.text])
    print(f"\n[windows {fixed_windows:.0f} -> {auto_windows:.0f}; WER {wer_fixed:.3f} -> {wer_auto:.3f}]")
    assert wer_auto <= wer_fixed + 0.02 and wer_auto < 0.35
    assert auto.duration == pytest.approx(duration, abs=0.05)
    assert auto.segments
    padded = [(a / SR - 0.05, b / SR + 0.05) for a, b in plan.speech_map.spans]
    for seg in auto.segments:
        assert 0 <= seg.start <= seg.end <= duration
        for t in (seg.start, seg.end):
            assert any(a <= t <= b for a, b in padded), (seg, padded)
    # every utterance is heard: some segment overlaps it (a segment may run across a removed pause)
    for a, b in truth:
        assert any(seg.start < b and seg.end > a for seg in auto.segments), (a, b)
    starts = [seg.start for seg in auto.segments]
    assert starts == sorted(starts)


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["silence", "noise"])
def test_no_speech_is_empty_in_every_format(whisper_engine, vad_clips, clip):
    path = vad_clips[clip]
    before = clips.finished_requests(whisper_engine.base_url)
    assert transcribe(whisper_engine, path, chunking_strategy="auto").text == ""
    verbose = transcribe(whisper_engine, path, chunking_strategy="auto", response_format="verbose_json")
    assert verbose.text == "" and verbose.segments in (None, []) and verbose.duration == pytest.approx(30, abs=0.05)
    assert transcribe(whisper_engine, path, chunking_strategy="auto", response_format="text").strip() == ""
    srt = transcribe(whisper_engine, path, chunking_strategy="auto", response_format="srt")
    assert [line for line in srt.splitlines() if line.strip() and not line[0].isdigit()] == []  # no cue text
    vtt = transcribe(whisper_engine, path, chunking_strategy="auto", response_format="vtt")
    assert [line for line in vtt.splitlines()[1:] if line.strip() and "-->" not in line] == []
    events = list(transcribe(whisper_engine, path, chunking_strategy="auto", stream=True))
    assert [e.type for e in events] == ["transcript.text.done"] and events[0].text == ""
    translation = whisper_engine.client().audio.translations.create(
        model=whisper_engine.name, file=path.open("rb"), temperature=0, extra_body={"chunking_strategy": "auto"}
    )
    assert translation.text == ""
    assert clips.finished_requests(whisper_engine.base_url) == before  # the engine never ran
    assert whisper_engine.alive()


@pytest.mark.slow
def test_server_vad_object_accepted(whisper_engine, vad_clips):
    path, text, _ = vad_clips["pauses"]
    obj = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
    typed = transcribe(whisper_engine, path, chunking_strategy=obj)  # the SDK's chunking_strategy[...] fields
    assert speech.word_error_rate([text], [typed.text]) < 0.35
    data, files = payloads.audio_form(payloads.transcription_kwargs(path, model=whisper_engine.name, language="en"))
    raw = httpx.post(
        f"{whisper_engine.base_url}/v1/audio/transcriptions",
        data={**data, "chunking_strategy": json.dumps(obj)},
        files=files,
        timeout=300,
    )
    assert raw.status_code == 200 and raw.json()["text"] == typed.text


@pytest.mark.slow
def test_default_from_setting_on_a_real_engine(whisper_model, whisper_engine, vad_clips, logs_dir):
    """An engine started with MMCPU_VAD_DEFAULT naming its model chunks by voice activity when a request names no
    strategy: the same answer as chunking_strategy="auto" on an engine without the setting, and silence never
    reaches the engine."""
    from mmcpu_dev.servers import test_engine

    path, _, _ = vad_clips["pauses"]
    before = clips.finished_requests(whisper_engine.base_url)
    auto = transcribe(whisper_engine, path, chunking_strategy="auto", response_format="verbose_json")
    auto_requests = clips.finished_requests(whisper_engine.base_url) - before
    with test_engine(whisper_model, logs_dir, "vad-default", env={"MMCPU_VAD_DEFAULT": whisper_model.name}) as engine:
        assert "Voice-activity chunking is the default" in engine.log_path.read_text()
        before = clips.finished_requests(engine.base_url)
        default = transcribe(engine, path, response_format="verbose_json")
        # The same speech windows reach the engine (fixed 30 s windows would be more of them), the same text.
        assert clips.finished_requests(engine.base_url) - before == auto_requests
        assert default.text == auto.text
        # The same segments; their times within 0.5 s. Not exact: in bf16 the windows' decoding depends on how the
        # scheduler batches them, so identical requests differ at a near-tied timestamp token. On an Intel Xeon
        # with AMX three identical auto requests on each of two engines gave two segmentations, the first
        # window's segment boundaries 7.664 / 12.664 s or 7.464 / 12.984 s (0.32 s apart), the text the same.
        assert len(default.segments) == len(auto.segments)
        for got, want in zip(default.segments, auto.segments, strict=True):
            assert got.text == want.text
            assert abs(got.start - want.start) <= 0.5 and abs(got.end - want.end) <= 0.5, (got, want)
        before = clips.finished_requests(engine.base_url)
        assert transcribe(engine, vad_clips["silence"]).text == ""
        assert clips.finished_requests(engine.base_url) == before
