"""The speech package (mmcpu.stt) against vLLM's patched speech serving, on ONE real engine: MRV2 on CPU, real Whisper
tiny.en, MMCPU_STT_ROUTES=plugin.

The package hands every request it does not cover to vLLM's serving (the response header says which answered, and
why), and a request with a field the package does not know is one of those. So each clip is sent twice to the same
engine: as it is (the package answers) and with one unknown field (vLLM's serving answers). json and text must be
identical. The timestamped formats (MMCPU_STT_TIMESTAMPS=align, the default) are json's decode timed by one alignment
forward: they must carry exactly json's words, with segment starts as close to the known speech as faster-whisper's."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import srt
import webvtt

from mmcpu.stt import ROUTE_HEADER
from mmcpu_dev import speech
from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.servers import assert_native_then_stop, test_engine, wait_for

pytestmark = pytest.mark.slow

RATE = 16_000
PROBE = {"mmcpu_test_probe": "1"}  # a field the package does not know: vLLM's serving answers
PLUGIN, VLLM = "plugin", "vllm; reason=extra_fields"


@pytest.fixture(scope="module")
def stt_engine(whisper_model: Path, patched_vllm: Path, logs_dir: Path):
    engine = test_engine(whisper_model, logs_dir, "stt-plugin", env={"MMCPU_STT_ROUTES": "plugin"}).start()
    log = engine.log()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert f"Endpoint plugin overrides POST {path}" in log, f"the mmcpu_stt plugin did not replace {path}"
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[tuple[float, float]]]:
    """~65 s of ten sentences with 3 s pauses (known silences: the ground truth of every sentence's start): three
    of vLLM's 30 s windows."""
    sentences = speech.SENTENCES + speech.MORE_SENTENCES
    path, spans = speech.conversation(tmp_path_factory.mktemp("stt") / "long.wav", sentences, pause_s=3.0)
    return path, sentences, [(a / RATE, b / RATE) for a, b in spans]


def post(engine, audio: Path, route: str, task: str = "transcriptions", **fields: str) -> httpx.Response:
    form = {"model": engine.name, "temperature": "0", **fields, **(PROBE if route == VLLM else {})}
    response = httpx.post(
        f"{engine.base_url}/v1/audio/{task}",
        data=form,
        files={"file": (audio.name, audio.read_bytes(), "audio/wav")},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    assert response.headers.get(ROUTE_HEADER) == route, (route, dict(response.headers))
    return response


def engine_requests(engine) -> float:
    """Engine requests finished so far (vLLM's counter): what one answer cost in decodes."""
    text = httpx.get(f"{engine.base_url}/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def clock(stamp: str) -> float:
    hours, minutes, seconds = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def words(text: str) -> list[str]:
    return speech.normalize(text).split()


@pytest.mark.parametrize("response_format", ["json", "text"])
@pytest.mark.parametrize("task", ["transcriptions", "translations"])
def test_json_and_text_identical(stt_engine, clips, long_clip, response_format, task):
    for audio in [path for path, _ in clips] + [long_clip[0]]:
        ours = post(stt_engine, audio, PLUGIN, task, response_format=response_format)
        theirs = post(stt_engine, audio, VLLM, task, response_format=response_format)
        assert ours.text == theirs.text, audio.name
        if response_format == "json":
            assert ours.json() == theirs.json()
    text = post(stt_engine, long_clip[0], PLUGIN, response_format="text").text
    assert speech.word_error_rate([" ".join(long_clip[1])], [text]) < WER_LIMIT


def test_stream_through_openai_sdk(stt_engine, clips, long_clip):
    """The typed stream read by OpenAI's SDK: deltas that add up to the done event's text, the same as vLLM's
    stream. (Not always json's text, byte for byte: a stream decodes its windows one after another, json decodes
    them in one batch, and batch composition can flip a word of this bfloat16 model.)"""
    client = stt_engine.client()

    def stream(audio: Path, route: str) -> tuple[list[str], object]:
        with client.audio.transcriptions.with_streaming_response.create(
            model=stt_engine.name, file=audio, temperature=0.0, stream=True, extra_body=PROBE if route == VLLM else None
        ) as raw:
            assert raw.headers.get(ROUTE_HEADER) == route
            events = list(raw.parse())
        (done,) = [e for e in events if e.type == "transcript.text.done"]
        return [e.delta for e in events if e.type == "transcript.text.delta"], done

    for audio in [clips[1][0], long_clip[0]]:
        deltas, done = stream(audio, PLUGIN)
        assert deltas and "".join(deltas) == done.text
        assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
        # The text and usage as vLLM's stream; not the same cut into deltas: vLLM merges the pending deltas of a
        # request when its reader lags (a loaded machine), for either route.
        _, their_done = stream(audio, VLLM)
        assert (done.text, done.usage) == (their_done.text, their_done.usage)
        if audio != long_clip[0]:  # one window: nothing else in the batch, json's text
            assert done.text == post(stt_engine, audio, VLLM, response_format="json").json()["text"]


def test_verbose_json_one_decode_per_window(stt_engine, clips):
    """A one-window clip costs the package one engine request in verbose_json, as in json (the alignment forward is
    a worker call, not a request); vLLM's patched serving spends two (json's decode, then the forced timing pass)."""
    audio = clips[1][0]
    costs = {}
    for route in (PLUGIN, VLLM):
        before = engine_requests(stt_engine)
        post(stt_engine, audio, route, response_format="verbose_json")
        costs[route] = engine_requests(stt_engine) - before
    assert costs == {PLUGIN: 1, VLLM: 2}, costs


def test_the_alignment_reuses_the_decodes_encoder_output(stt_engine, clips):
    """A one-window verbose_json: the alignment forward finds the encoder output its decode left in the worker
    (mmcpu/encoder_stash.py) instead of running the encoder again; the engine logs each alignment."""
    marker = "Whisper alignment: "
    before = stt_engine.log().count(marker)
    post(stt_engine, clips[2][0], PLUGIN, response_format="verbose_json")
    wait_for(lambda: stt_engine.log().count(marker) > before, 30, "the alignment's log line")
    lines = [line for line in stt_engine.log().splitlines() if marker in line][before:]
    assert len(lines) == 1 and "encoder output reused" in lines[0], lines


def cue_texts(body: str, response_format: str) -> list[str]:
    if response_format == "srt":
        return [c.content for c in srt.parse(body)]
    return [c.text for c in webvtt.from_string(body)]


def test_timestamped_formats_keep_json_words(stt_engine, clips, long_clip):
    """The word-loss sweep: verbose_json (its text and its segments), srt and vtt carry exactly json's words, on
    every clip (the 65 s one too: three windows)."""
    for audio in [path for path, _ in clips] + [long_clip[0]]:
        expected = words(post(stt_engine, audio, PLUGIN, response_format="json").json()["text"])
        doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
        assert words(doc["text"]) == expected, audio.name
        assert words(" ".join(s["text"] for s in doc["segments"])) == expected, audio.name
        for fmt in ("srt", "vtt"):
            body = post(stt_engine, audio, PLUGIN, response_format=fmt).text
            texts = cue_texts(body, fmt)
            assert all(t.strip() for t in texts), body
            got = " ".join(texts)
            if fmt == "vtt":
                got = got.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
            assert words(got) == expected, (audio.name, fmt)


def test_segments_against_ground_truth(stt_engine, long_clip, fw_reference):
    """Segment starts against the known starts of the spoken sentences: for each sentence, the distance to the
    nearest segment start; mean and max within faster-whisper's (same weights, same clip) + 0.1 s."""
    audio, sentences, spans = long_clip
    doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
    segments = doc["segments"]
    print("\n" + "\n".join(f"{s['start']:6.2f} {s['end']:6.2f} {s['text']}" for s in segments))
    starts = [s["start"] for s in segments]
    assert starts == sorted(starts) and all(0 <= s["start"] <= s["end"] <= doc["duration"] for s in segments)
    assert [s["id"] for s in segments] == list(range(len(segments)))

    def errors(found: list[float]) -> tuple[float, float]:
        gaps = [min(abs(f - a) for f in found) for a, _ in spans]
        return sum(gaps) / len(gaps), max(gaps)

    (fw,) = fw_reference.transcribe([audio], fw_reference.weights("whisper-tiny.en"))
    ours, theirs = errors(starts), errors([s["start"] for s in fw["segments"]])
    print(
        f"segment start error mean / max: ours {ours[0]:.2f} / {ours[1]:.2f} s, faster-whisper {theirs[0]:.2f} / "
        f"{theirs[1]:.2f} s"
    )
    assert ours[0] <= theirs[0] + 0.1 and ours[1] <= theirs[1] + 0.1
    # and every segment's text lies in time within the sentences it holds
    for s in segments:
        inside = [i for i, (a, b) in enumerate(spans) if s["start"] < b and s["end"] > a]
        assert inside, s


def test_word_timestamps_from_the_alignment(stt_engine, long_clip):
    """``timestamp_granularities=[word]`` is answered by the package from the same alignment: json's words, each
    inside the clip, in order."""
    audio = long_clip[0]
    doc = post(
        stt_engine, audio, PLUGIN, response_format="verbose_json", **{"timestamp_granularities[]": ["word", "segment"]}
    ).json()
    json_text = post(stt_engine, audio, PLUGIN, response_format="json").json()["text"]
    found = doc["words"]
    assert words(" ".join(w["word"] for w in found)) == words(json_text)
    assert all(0 <= w["start"] <= w["end"] <= doc["duration"] for w in found)
    assert all(a["start"] <= b["start"] for a, b in zip(found, found[1:], strict=False))
    # every segment's span holds its words
    for seg in doc["segments"]:
        inner = [w for w in found if seg["start"] <= w["start"] < seg["end"]]
        assert inner, seg
    without = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
    assert "words" not in without or without["words"] is None


def test_include_logprobs(stt_engine, clips):
    """``include[]=logprobs`` with json: OpenAI's logprobs array, one entry per generated token, whose texts make up
    the answer's text; the text itself is json's. With another format it goes to vLLM's serving (ignored, as ever)."""
    audio = clips[1][0]
    plain = post(stt_engine, audio, PLUGIN, response_format="json").json()
    doc = post(stt_engine, audio, PLUGIN, response_format="json", **{"include[]": "logprobs"}).json()
    assert doc["text"] == plain["text"] and "logprobs" not in plain
    entries = doc["logprobs"]
    assert entries and all(set(e) == {"token", "logprob", "bytes"} for e in entries)
    assert all(e["logprob"] <= 0 for e in entries)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == doc["text"]
    assert "".join(e["token"] for e in entries) == doc["text"]
    other = post(stt_engine, audio, "vllm; reason=include", response_format="text", **{"include[]": "logprobs"})
    assert other.text.strip()


@pytest.mark.parametrize("seconds", [3, 5])
def test_silence_is_a_whole_answer(stt_engine, tmp_path, seconds):
    import numpy as np
    import soundfile

    audio = tmp_path / f"silence{seconds}.wav"
    soundfile.write(audio, np.zeros(seconds * RATE, dtype=np.int16), RATE, subtype="PCM_16")
    doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
    assert all(s["text"].strip() for s in doc["segments"]), doc
    for fmt in ("srt", "vtt"):
        body = post(stt_engine, audio, PLUGIN, response_format=fmt).text
        assert all(t.strip() for t in cue_texts(body, fmt)), body
    doc = post(
        stt_engine, audio, PLUGIN, response_format="verbose_json", **{"timestamp_granularities[]": "word"}
    ).json()
    assert isinstance(doc["words"], list)
    assert stt_engine.alive()


@pytest.mark.parametrize("response_format", ["srt", "vtt"])
def test_subtitles_parse_and_match_segments(stt_engine, long_clip, response_format):
    audio = long_clip[0]
    doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
    body = post(stt_engine, audio, PLUGIN, response_format=response_format).text
    if response_format == "srt":
        cues = [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(body)]
    else:
        cues = [(clock(c.start), clock(c.end), c.text) for c in webvtt.from_string(body)]
    expected = [(s["start"], s["end"], s["text"].strip()) for s in doc["segments"]]
    assert [c[2] for c in cues] == [e[2] for e in expected]
    assert all(abs(c[0] - e[0]) < 0.002 and abs(c[1] - e[1]) < 0.002 for c, e in zip(cues, expected, strict=False))


def test_errors_are_4xx_naming_the_parameter(stt_engine, clips):
    cases = [
        ({"language": "de"}, clips[0][0].read_bytes(), "language"),
        ({}, b"not audio" * 50, "file"),
        ({}, b"", "file"),
    ]
    for fields, data, param in cases:
        response = httpx.post(
            f"{stt_engine.base_url}/v1/audio/transcriptions",
            data={"model": stt_engine.name, **fields},
            files={"file": ("a.wav", data, "audio/wav")},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    assert stt_engine.alive()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"response_format": "diarized_json"}, "response_format"),
        ({"response_format": "srt", "timestamp_granularities[]": "word"}, "timestamp_granularities"),
        ({"timestamp_granularities[]": "segment"}, "timestamp_granularities"),
        ({"chunking_strategy": "auto"}, "chunking_strategy"),
        ({"model": "no-such-model"}, "model"),
    ],
)
def test_uncovered_requests_go_to_vllm(stt_engine, clips, fields, reason):
    """What the package does not cover yet is answered by vLLM's serving as before (its answer or its error)."""
    form = {"model": stt_engine.name, "temperature": "0", **fields}
    response = httpx.post(
        f"{stt_engine.base_url}/v1/audio/transcriptions",
        data=form,
        files={"file": ("a.wav", clips[1][0].read_bytes(), "audio/wav")},
        timeout=300,
    )
    assert response.headers.get(ROUTE_HEADER) == f"vllm; reason={reason}", (response.status_code, response.text)
    assert response.status_code in (200, 400, 404), response.text
    if fields.get("timestamp_granularities[]") == "segment":  # json: vLLM's 400
        assert response.status_code == 400 and response.json()["error"]["param"] == "timestamp_granularities"
