"""The speech package (mmcpu.stt) against vLLM's patched speech serving, on ONE real engine: MRV2 on CPU, real Whisper
tiny.en, MMCPU_STT_ROUTES=plugin.

The package hands every request it does not cover to vLLM's serving (the response header says which answered, and
why), and a request with a field the package does not know is one of those. So each clip is sent twice to the same
engine: as it is (the package answers) and with one unknown field (vLLM's serving answers). json and text must be
identical; the timestamped formats decode once per window in the package and must keep every sentence spoken, with
times that fit the known speech."""

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
from mmcpu_dev.servers import assert_native_then_stop, test_engine

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
    """~51 s of ten sentences with 1.5 s pauses: two of vLLM's 30 s windows, one sentence at the first's end."""
    sentences = speech.SENTENCES + speech.MORE_SENTENCES
    path, spans = speech.conversation(tmp_path_factory.mktemp("stt") / "long.wav", sentences, pause_s=1.5)
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
    """A one-window clip costs the package one engine request in verbose_json, as in json; vLLM's patched serving
    spends two (json's decode, then the forced timing pass)."""
    audio = clips[1][0]
    costs = {}
    for route in (PLUGIN, VLLM):
        before = engine_requests(stt_engine)
        post(stt_engine, audio, route, response_format="verbose_json")
        costs[route] = engine_requests(stt_engine) - before
    assert costs == {PLUGIN: 1, VLLM: 2}, costs


def test_verbose_json_keeps_every_sentence(stt_engine, long_clip):
    """Every sentence is in the segments (the one at the first window's end too: the window's unfinished tail is
    decoded again from its last timestamp), as close to the reference as json's text, with each sentence inside
    segments that cover it in time."""
    audio, sentences, spans = long_clip
    doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json").json()
    json_text = post(stt_engine, audio, VLLM, response_format="json").json()["text"]
    segments = doc["segments"]
    print("\n" + "\n".join(f"{s['start']:6.2f} {s['end']:6.2f} {s['text']}" for s in segments))
    assert doc["text"] == "".join(s["text"] for s in segments).strip()
    reference = " ".join(sentences)
    ours, theirs = (speech.word_error_rate([reference], [t]) for t in (doc["text"], json_text))
    print(f"WER against the reference: verbose_json {ours:.3f}, json {theirs:.3f}")
    assert ours < WER_LIMIT and ours <= theirs + 0.05
    assert len(words(doc["text"])) >= len(words(reference)) - 3, "words lost"
    starts = [s["start"] for s in segments]
    assert starts == sorted(starts) and all(0 <= s["start"] <= s["end"] <= doc["duration"] for s in segments)
    assert [s["id"] for s in segments] == list(range(len(segments)))
    for sentence, (a, b) in zip(sentences, spans, strict=False):
        # The segments that overlap the sentence's speech hold most of its words.
        near = " ".join(s["text"] for s in segments if s["start"] < b - 0.3 and s["end"] > a + 0.3)
        found = set(words(near))
        assert len([w for w in words(sentence) if w in found]) >= 0.6 * len(words(sentence)), (sentence, a, b, near)
    # Times fit the speech: the first segment starts by the first word, the last ends after the last one began.
    assert starts[0] <= spans[0][0] + 1.0 and segments[-1]["end"] >= spans[-1][0]


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
        ({"response_format": "verbose_json", "timestamp_granularities[]": "word"}, "timestamp_granularities"),
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
    if fields.get("timestamp_granularities[]") == "word":
        assert response.status_code == 200 and response.json()["words"]
    if fields.get("timestamp_granularities[]") == "segment":  # json: vLLM's 400
        assert response.status_code == 400 and response.json()["error"]["param"] == "timestamp_granularities"
