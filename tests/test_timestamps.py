"""Timestamps that keep every word: verbose_json, srt and vtt (the speech package, mmcpu/stt) time json's own text and
their segments carry exactly the json text's words; Whisper's timestamp rules (mmcpu/whisper_timestamps.py) for
MMCPU_STT_TIMESTAMPS=decode.

Fast: the logits processor's rules on hand-made token histories, and the launcher naming it for MRV2 speech
engines only. Slow: real MRV2 engines (tiny.en, its int8 variant, whisper-base with a language and with
detection) on espeak-ng clips of 2.5 s to ~2.5 min, against json for the same greedy request and against
faster-whisper on the same weights (mmcpu_dev/reference.py); subtitles parsed by PyPI ``srt`` and ``webvtt-py``.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import torch

from mmcpu import launch
from mmcpu.config import Settings, get_settings
from mmcpu_dev import speech, timestamps
from mmcpu_dev.servers import Engine

SETTINGS = get_settings()

# --- fast: the rules ------------------------------------------------------------------------------------------
TB, EOT, NO_TS, VOCAB = 100, 50, 99, 100 + 1501 + 3  # a toy vocabulary: text < 50, specials 50..99, timestamps


def processor(histories: list[list[int]], prompt_len: int = 3, text: list[int] | None = None):
    from vllm.sampling_params import SamplingParams

    from mmcpu.whisper_timestamps import WhisperTimestamps, request_args

    n = len(histories)
    width = max(len(h) for h in histories) + 1
    tokens = torch.zeros((n + 1, width), dtype=torch.int32)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = torch.tensor(h)
    states = SimpleNamespace(
        max_num_reqs=n + 1,
        all_token_ids=SimpleNamespace(gpu=tokens),
        prompt_len=SimpleNamespace(gpu=torch.full((n + 1,), prompt_len, dtype=torch.int32)),
    )
    proc = WhisperTimestamps(None, states)
    on = SamplingParams(extra_args=request_args(TB, EOT, NO_TS, text=text))
    assert all(proc.add_request(i, on) for i in range(n))
    assert proc.add_request(n, SamplingParams()) is False  # not timestamped: declined
    slots = torch.arange(n + 1)
    ctx = SimpleNamespace(
        expanded_idx_mapping=slots,
        idx_mapping_np=slots.numpy(),
        pos=torch.tensor([len(h) - 1 for h in histories] + [0]),
        input_ids=torch.tensor([h[-1] for h in histories] + [0]),
    )
    return proc, ctx


def allowed(
    histories: list[list[int]], logits: torch.Tensor | None = None, text: list[int] | None = None
) -> list[set[int]]:
    proc, ctx = processor(histories, text=text)
    n = len(histories)
    if logits is None:  # text likely: the forcing rule stays out of the way
        logits = torch.zeros((n + 1, VOCAB))
        logits[:, : EOT + 1] = 10.0
    before = logits[n].clone()
    out = proc.apply(logits, ctx)
    assert torch.equal(out[n], before), "a declined request's row must not change"
    return [set(torch.isfinite(out[i]).nonzero().squeeze(1).tolist()) for i in range(n)]


PROMPT = [1, 2, 3]
TIMESTAMPS = set(range(TB, TB + 1501))
TEXT = set(range(EOT))


def test_first_token_is_a_timestamp_within_one_second():
    (first,) = allowed([PROMPT])
    assert first == set(range(TB, TB + 51))  # <|0.00|> .. <|1.00|>


def test_after_text_a_timestamp_not_before_the_last_or_text():
    (a,) = allowed([[*PROMPT, TB + 10, 5, 6]])
    assert a == TEXT | {EOT} | set(range(TB + 11, TB + 1501))  # no <|notimestamps|>, no specials, > 0.20


def test_a_closing_timestamp_is_followed_by_a_timestamp_or_the_end():
    (a,) = allowed([[*PROMPT, TB + 10, 5, TB + 40]])
    assert a == {EOT} | set(range(TB + 40, TB + 1501))


def test_after_a_pair_text_follows():
    (a,) = allowed([[*PROMPT, TB + 10, 5, TB + 40, TB + 40]])
    assert a == TEXT | {EOT}


def test_a_likely_timestamp_is_forced():
    logits = torch.zeros((2, VOCAB))
    logits[0, TB + 20 : TB + 1501] = 3.0  # timestamps together far likelier than any text token
    (a,) = allowed([[*PROMPT, TB + 10, 5]], logits)
    assert a == set(range(TB + 11, TB + 1501))


def test_rows_in_one_batch_follow_their_own_history():
    first, after_pair = allowed([PROMPT, [*PROMPT, TB, 7, TB + 5, TB + 5]])
    assert first == set(range(TB, TB + 51)) and after_pair == TEXT | {EOT}


def test_forced_text_leaves_only_the_timestamps_to_choose():
    """json's text forced: its next token or a timestamp, the end only once all of it came."""
    text = [5, 6, 7]
    assert allowed([PROMPT], text=text) == [set(range(TB, TB + 51))]  # first a timestamp, as without
    assert allowed([[*PROMPT, TB + 10]], text=text) == [{5}]  # its first token; no end yet
    assert allowed([[*PROMPT, TB + 10, 5]], text=text) == [{6} | set(range(TB + 11, TB + 1501))]
    assert allowed([[*PROMPT, TB + 10, 5, TB + 40, TB + 40]], text=text) == [{6}]  # after a pair: the text goes on
    # All of it came: no more text, a closing timestamp or the end.
    assert allowed([[*PROMPT, TB + 10, 5, 6, 7]], text=text) == [{EOT} | set(range(TB + 11, TB + 1501))]
    assert allowed([[*PROMPT, TB + 10, 5, 6, 7, TB + 60, TB + 60]], text=text) == [{EOT}]


def test_forced_text_with_likely_timestamps_and_per_row():
    logits = torch.zeros((3, VOCAB))
    logits[:, TB + 20 : TB + 1501] = 3.0  # timestamps likelier than the forced token: one is forced
    forced, free = allowed([[*PROMPT, TB + 10, 5], [*PROMPT, TB + 10, 5]], logits, text=[5, 6])
    assert forced == free == set(range(TB + 11, TB + 1501))
    proc, ctx = processor([[*PROMPT, TB + 10, 5], [*PROMPT, TB + 10, 5]], text=[5, 6])
    from vllm.sampling_params import SamplingParams

    from mmcpu.whisper_timestamps import request_args

    proc.add_request(1, SamplingParams(extra_args=request_args(TB, EOT, NO_TS)))  # row 1: rules, no forced text
    logits = torch.zeros((3, VOCAB))
    logits[:, : EOT + 1] = 10.0
    out = proc.apply(logits, ctx)
    assert torch.isfinite(out[0]).nonzero().squeeze(1).tolist() == [6, *range(TB + 11, TB + 1501)]
    assert set(torch.isfinite(out[1]).nonzero().squeeze(1).tolist()) == TEXT | {EOT} | set(range(TB + 11, TB + 1501))


def test_invalid_extra_args_are_refused():
    from vllm.sampling_params import SamplingParams

    from mmcpu.whisper_timestamps import KEY, WhisperTimestamps

    with pytest.raises(ValueError, match=KEY):
        WhisperTimestamps.validate_params(SamplingParams(extra_args={KEY: {"timestamp_begin": "x"}}))
    with pytest.raises(ValueError, match="text"):  # a forced text holds text tokens only
        WhisperTimestamps.validate_params(
            SamplingParams(
                extra_args={
                    KEY: {
                        "timestamp_begin": TB,
                        "eot": EOT,
                        "no_timestamps": NO_TS,
                        "max_initial": 50,
                        "text": [5, EOT],
                    }
                }
            )
        )
    WhisperTimestamps.validate_params(SamplingParams())


def test_seek_index_is_where_whisper_resumes():
    """openai-whisper's transcribe loop: a window closed by a lone timestamp is done; one that ends in text or in a
    pair opening an empty segment resumes at its last timestamp; the generated tokens end at the first EOT."""
    from mmcpu.whisper_timestamps import seek_index

    def at(tokens: list[int]) -> int | None:
        return seek_index(tokens, TB, EOT)

    assert at([TB, 7, 8, TB + 90, EOT]) is None  # text <|1.80|>: closed
    assert at([TB, 7, TB + 90, TB + 95, 8, TB + 400]) is None  # no EOT, closed all the same
    assert at([TB, 7, TB + 90, TB + 95, EOT]) == 3  # a pair opens a segment with no text: resume at <|1.90|>
    assert at([TB, 7, TB + 90, TB + 95, 8, 9, EOT]) == 3  # open text: resume at its start
    assert at([TB, 7, 8, 9]) == 0  # open from the first timestamp
    assert at([TB, 7, TB + 90, EOT, TB + 95, 8]) is None  # after EOT nothing counts
    assert at([7, 8, EOT]) is None and at([]) is None  # no timestamp at all
    assert at([TB + 5, EOT]) == 0  # a lone opening timestamp


def test_launcher_names_the_processor_for_mrv2_speech_only(tmp_path: Path):
    from mmcpu import whisper_timestamps

    assert launch.TIMESTAMP_RULES == whisper_timestamps.FQCN
    whisper = str(SETTINGS.models_dir / "whisper-tiny.en")
    flag = ["--logits-processors", launch.TIMESTAMP_RULES]

    def has(argv: list[str]) -> bool:
        return any(argv[i : i + 2] == flag for i in range(len(argv)))

    assert has(launch.engine_argv(whisper, Settings(), port=8001))
    assert not has(launch.engine_argv(whisper, Settings(runner="v1"), port=8001))  # V1 has its own interface
    assert not has(launch.engine_argv(str(SETTINGS.models_dir / "tiny-llava"), Settings(), port=8002))


# --- slow: real engines -------------------------------------------------------------------------------------
# verbose_json times json's own text (the package's alignment of json's decode), so its segments, srt and
# vtt carry exactly json's words, compared after mmcpu_dev.speech.normalize (case, punctuation, spacing).
# Segment count against faster-whisper (same weights, greedy, timestamps): vLLM cuts windows where split_audio
# finds a quiet point and faster-whisper seeks to its last timestamp, so long clips differ by a few segments.
COUNT_SLACK = 0.5  # |ours - fw| <= max(2, 50 % of fw)
CLIP_SET = [("s0-130", 0, 130), ("s7-160", 7, 160), ("s12-160", 12, 160), ("s48-160", 48, 160)]


def speech_extent(path: Path) -> tuple[float, float]:
    """First and last 20 ms frame above 2 % of the peak level: where the speech is."""
    audio, rate = soundfile.read(str(path), dtype="float32")
    frames = np.abs(audio[: len(audio) // 320 * 320]).reshape(-1, 320).max(axis=1)
    loud = np.nonzero(frames > 0.02 * frames.max())[0]
    return loud[0] * 0.02, (loud[-1] + 1) * 0.02


@pytest.fixture(scope="module")
def ts_clips(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path, float]]:
    out = tmp_path_factory.mktemp("timestamps")
    made = []
    for name, n, speed in CLIP_SET:
        if n == 0:  # ~2.5 s
            path = speech.synthesize(speech.SENTENCES[3], out / f"{name}.wav", speed=speed)
            made.append((name, path, soundfile.info(str(path)).duration))
        else:
            made.append((name, *timestamps.clip(name, n, speed, out)))
    return made


def check_response(engine: Engine, clips: list, fw: list[dict] | None, **fields: object) -> None:
    import srt
    import webvtt

    for (name, path, seconds), ref in zip(clips, fw or [None] * len(clips), strict=True):
        plain = timestamps.transcribe(engine.base_url, engine.name, path, "json", **fields)["text"]
        body = timestamps.transcribe(engine.base_url, engine.name, path, "verbose_json", **fields)
        segs = body["segments"]
        assert segs, name
        assert body["text"] == "".join(s["text"] for s in segs).strip(), name
        assert [s["id"] for s in segs] == list(range(len(segs))), name
        assert all(0 <= s["start"] <= s["end"] <= seconds + 1e-6 for s in segs), name
        assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(segs, segs[1:], strict=False)), name
        assert timestamps.words(body["text"]) == timestamps.words(plain), (name, plain, body["text"])
        first, last = speech_extent(path)
        for fmt in ("srt", "vtt"):
            text = timestamps.transcribe(engine.base_url, engine.name, path, fmt, **fields)
            if fmt == "srt":
                cues = [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(text)]
            else:
                cues = [(c.start_in_seconds, c.end_in_seconds, c.text) for c in webvtt.from_buffer(io.StringIO(text))]
            assert timestamps.words(" ".join(c[2] for c in cues)) == timestamps.words(plain), (name, fmt)
            assert all(a <= b <= seconds + 1e-3 for a, b, _ in cues), (name, fmt)
            assert all(p[1] <= q[0] + 1e-3 for p, q in zip(cues, cues[1:], strict=False)), (name, fmt)
            # cover the speech: from its first second to its last
            assert cues[0][0] <= first + 1.0 and cues[-1][1] >= last - 2.0, (name, fmt, cues[0], cues[-1], first, last)
        if ref is not None:
            assert abs(len(segs) - len(ref["segments"])) <= max(2, COUNT_SLACK * len(ref["segments"])), (
                name,
                len(segs),
                len(ref["segments"]),
            )


@pytest.mark.slow
def test_tiny_en_segments_keep_the_words(whisper_engine: Engine, ts_clips, fw_reference):
    fw = fw_reference.transcribe([p for _, p, _ in ts_clips], fw_reference.weights("whisper-tiny.en"))
    check_response(whisper_engine, ts_clips, fw)


@pytest.mark.slow
def test_int8_segments_keep_the_words(int8_engine: Engine, ts_clips, fw_reference):
    """The audio role's default checkpoint (int8 linears): the same words, subtitles and segment counts."""
    clips = ts_clips[:3]  # 2.5-40 s: one and two windows
    fw = fw_reference.transcribe([p for _, p, _ in clips], fw_reference.weights("whisper-tiny.en"), compute_type="int8")
    check_response(int8_engine, clips, fw)


@pytest.mark.slow
def test_default_temperature_works(whisper_engine: Engine, ts_clips):
    name, path, seconds = ts_clips[1]
    body = timestamps.transcribe(whisper_engine.base_url, whisper_engine.name, path, "verbose_json", temperature=None)
    assert body["segments"] and body["segments"][-1]["end"] <= seconds


@pytest.mark.slow
def test_whisper_base_with_language_and_detection(base_engine: Engine, ts_clips, tmp_path: Path):
    check_response(base_engine, ts_clips[:2], None, language="en")
    fr = speech.synthesize(
        speech.PASSAGES["fr"],
        tmp_path / "fr.wav",
        speed=speech.PASSAGE_SPEED,
        voice=speech.PASSAGE_VOICE.format(lang="fr"),
    )
    body = timestamps.transcribe(base_engine.base_url, base_engine.name, fr, "verbose_json")
    assert body["language"] == "fr" and body["segments"], body
    assert not math.isclose(body["segments"][-1]["end"], 30.0)
