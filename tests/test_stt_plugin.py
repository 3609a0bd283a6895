"""The speech package (mmcpu.stt, the default MMCPU_STT_ROUTES=plugin) on a real engine: MRV2 on CPU, real Whisper
tiny.en; against vLLM's own speech serving (MMCPU_STT_ROUTES=vllm) on a second engine.

The package hands only LoRA / unknown model names and diarized_json to vLLM's serving (the response header says
which answered, and why). json must be vLLM's, byte for byte. The timestamped formats
(MMCPU_STT_TIMESTAMPS=align, the default) are json's decode timed by one alignment forward: they must carry exactly
json's words, with segment starts as close to the known speech as faster-whisper's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
PLUGIN = "plugin"


@pytest.fixture(scope="module")
def stt_engine(whisper_model: Path, patched_vllm: Path, logs_dir: Path):
    engine = test_engine(whisper_model, logs_dir, "stt-plugin").start()  # the default settings
    log = engine.log()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert f"Endpoint plugin overrides POST {path}" in log, f"the mmcpu_stt plugin did not replace {path}"
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="module")
def vllm_engine(whisper_model: Path, patched_vllm: Path, logs_dir: Path):
    """The opt-out: vLLM's own speech serving, no endpoint plugin."""
    engine = test_engine(whisper_model, logs_dir, "stt-vllm", env={"MMCPU_STT_ROUTES": "vllm"}).start()
    assert "Endpoint plugin overrides" not in engine.log()
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[tuple[float, float]]]:
    """~65 s of ten sentences with 3 s pauses (known silences: the ground truth of every sentence's start): three
    of vLLM's 30 s windows."""
    sentences = speech.SENTENCES + speech.MORE_SENTENCES
    path, spans = speech.conversation(tmp_path_factory.mktemp("stt") / "long.wav", sentences, pause_s=3.0)
    return path, sentences, [(a / RATE, b / RATE) for a, b in spans]


def send(engine, audio: Path, task: str = "transcriptions", **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{engine.base_url}/v1/audio/{task}",
        data={"model": engine.name, "temperature": "0", **fields},
        files={"file": (audio.name, audio.read_bytes(), "audio/wav")},
        timeout=300,
    )


def post(engine, audio: Path, route: str | None, task: str = "transcriptions", **fields: Any) -> httpx.Response:
    response = send(engine, audio, task, **fields)
    assert response.status_code == 200, response.text
    assert response.headers.get(ROUTE_HEADER) == route, (route, dict(response.headers))
    return response


def refused(engine, audio: Path, param: str, **fields: Any) -> dict[str, Any]:
    """A 400 in OpenAI's error schema naming ``param``, answered by the package."""
    response = send(engine, audio, **fields)
    assert response.status_code == 400, response.text
    assert response.headers.get(ROUTE_HEADER) == PLUGIN, dict(response.headers)
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    return dict(error)


def engine_requests(engine) -> float:
    """Engine requests finished so far (vLLM's counter): what one answer cost in decodes."""
    text = httpx.get(f"{engine.base_url}/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def clock(stamp: str) -> float:
    hours, minutes, seconds = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def words(text: str) -> list[str]:
    return speech.normalize(text).split()


@pytest.mark.parametrize("task", ["transcriptions", "translations"])
def test_json_and_text_as_vllms_own_serving(stt_engine, vllm_engine, clips, long_clip, task):
    """json is vLLM's own serving's document, byte for byte; text is its text (vLLM's own serving has no text
    format: a 400 there)."""
    for audio in [path for path, _ in clips] + [long_clip[0]]:
        ours = post(stt_engine, audio, PLUGIN, task, response_format="json")
        theirs = post(vllm_engine, audio, None, task, response_format="json")
        assert ours.json() == theirs.json(), audio.name
        text = post(stt_engine, audio, PLUGIN, task, response_format="text").text
        assert text == theirs.json()["text"].strip() + "\n", audio.name
    text = post(stt_engine, long_clip[0], PLUGIN, response_format="text").text
    assert speech.word_error_rate([" ".join(long_clip[1])], [text]) < WER_LIMIT
    unknown = post(stt_engine, clips[1][0], PLUGIN, response_format="json", mmcpu_test_probe="1")
    assert unknown.json() == post(stt_engine, clips[1][0], PLUGIN, response_format="json").json()  # ignored


def test_stream_through_openai_sdk(stt_engine, clips, long_clip):
    """The typed stream read by OpenAI's SDK: deltas that add up to the done event's text, the same as vLLM's
    stream. (Not always json's text, byte for byte: a stream decodes its windows one after another, json decodes
    them in one batch, and batch composition can flip a word of this bfloat16 model.)"""
    client = stt_engine.client()

    def stream(audio: Path, **extra: Any) -> tuple[list[Any], Any]:
        with client.audio.transcriptions.with_streaming_response.create(
            model=stt_engine.name, file=audio, temperature=0.0, stream=True, extra_body=extra or None
        ) as raw:
            assert raw.headers.get(ROUTE_HEADER) == PLUGIN
            events = list(raw.parse())
        (done,) = [e for e in events if e.type == "transcript.text.done"]
        return [e for e in events if e.type == "transcript.text.delta"], done

    for audio in [clips[1][0], long_clip[0]]:
        deltas, done = stream(audio)
        assert deltas and "".join(e.delta for e in deltas) == done.text
        assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
        if audio != long_clip[0]:  # one window: nothing else in the batch, json's text
            assert done.text == post(stt_engine, audio, PLUGIN, response_format="json").json()["text"]
    # vLLM's stream_continuous_usage_stats: the running usage on every delta, growing to the done event's
    deltas, done = stream(clips[1][0], stream_include_usage=True, stream_continuous_usage_stats=True)
    outputs = [e.usage["output_tokens"] for e in deltas]  # an extra to OpenAI's type: a dict
    assert outputs == sorted(outputs) and 0 < outputs[-1] <= done.usage.output_tokens


def test_verbose_json_one_decode_per_window(stt_engine, clips):
    """A one-window clip costs the package one engine request in verbose_json, as in json (the alignment forward is
    a worker call, not a request)."""
    audio = clips[1][0]
    costs = {}
    for fmt in ("json", "verbose_json"):
        before = engine_requests(stt_engine)
        post(stt_engine, audio, PLUGIN, response_format=fmt)
        costs[fmt] = engine_requests(stt_engine) - before
    assert costs == {"json": 1, "verbose_json": 1}, costs


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
    the answer's text; the text itself is json's. With another format or a stream it is a 400 naming include[]."""
    audio = clips[1][0]
    plain = post(stt_engine, audio, PLUGIN, response_format="json").json()
    doc = post(stt_engine, audio, PLUGIN, response_format="json", **{"include[]": "logprobs"}).json()
    assert doc["text"] == plain["text"] and "logprobs" not in plain
    entries = doc["logprobs"]
    assert entries and all(set(e) == {"token", "logprob", "bytes"} for e in entries)
    assert all(e["logprob"] <= 0 for e in entries)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == doc["text"]
    assert "".join(e["token"] for e in entries) == doc["text"]
    refused(stt_engine, audio, "include[]", response_format="text", **{"include[]": "logprobs"})
    refused(stt_engine, audio, "include[]", response_format="json", **{"include[]": "no-such-thing"})


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
        assert response.headers.get(ROUTE_HEADER) == PLUGIN
    # refused by vLLM's request model before the route runs: the header all the same
    response = send(stt_engine, clips[0][0], stream_include_usage="true")
    assert response.status_code == 400 and response.headers.get(ROUTE_HEADER) == PLUGIN, response.text
    assert stt_engine.alive()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [({"response_format": "diarized_json"}, "response_format"), ({"model": "no-such-model"}, "model")],
)
def test_handed_to_vllm(stt_engine, clips, fields, reason):
    """What vLLM's own serving refuses correctly is handed to it (its error, the reason in the header)."""
    response = send(stt_engine, clips[1][0], **fields)
    assert response.headers.get(ROUTE_HEADER) == f"vllm; reason={reason}", (response.status_code, response.text)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "text", "timestamp_granularities[]": "word"}, "timestamp_granularities"),
        ({"timestamp_granularities[]": "segment"}, "timestamp_granularities"),  # json
        ({"response_format": "verbose_json", "stream": "true"}, "response_format"),
        ({"chunking_strategy": "sometimes"}, "chunking_strategy"),
        (
            {"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "20000"},
            "chunking_strategy",
        ),
        ({"use_beam_search": "true", "response_format": "verbose_json"}, "use_beam_search"),
        ({"use_beam_search": "true", "response_format": "srt"}, "use_beam_search"),
        ({"use_beam_search": "true", "stream": "true"}, "use_beam_search"),
        ({"use_beam_search": "true", "chunking_strategy": "auto"}, "use_beam_search"),
    ],
)
def test_what_the_package_does_not_serve_is_a_400(stt_engine, clips, fields, param):
    error = refused(stt_engine, clips[1][0], param, **fields)
    if param == "chunking_strategy" and "prefix_padding_ms" in str(fields):
        assert "prefix_padding_ms" in error["message"]
    assert stt_engine.alive()


def test_beam_search_is_a_400_silence_and_vad_too(stt_engine, clips, tmp_path):
    """use_beam_search is refused in every format (vLLM's own beam search for Whisper runs one engine request per
    token and past the end of the text, docs/api.md): on 5 s of silence with chunking_strategy=auto too, a 400
    naming use_beam_search, not a 500."""
    import numpy as np
    import soundfile

    silence = tmp_path / "silence5.wav"
    soundfile.write(silence, np.zeros(5 * RATE, dtype=np.int16), RATE, subtype="PCM_16")
    for fmt in ("json", "text"):
        error = refused(stt_engine, clips[1][0], "use_beam_search", use_beam_search="true", response_format=fmt)
        assert "greedily" in error["message"]
    refused(stt_engine, silence, "use_beam_search", use_beam_search="true", chunking_strategy="auto")
    assert post(stt_engine, silence, PLUGIN, chunking_strategy="auto").json()["text"] == ""
    assert stt_engine.alive()


def test_voice_activity_chunking_in_every_format(stt_engine, tmp_path, long_clip):
    """chunking_strategy=auto is served by the package: silence is a whole empty answer in every format (no cue,
    no engine request); speech keeps json's words, its times in the clip."""
    import numpy as np
    import soundfile

    silence = tmp_path / "silence5.wav"
    soundfile.write(silence, np.zeros(5 * RATE, dtype=np.int16), RATE, subtype="PCM_16")
    before = engine_requests(stt_engine)
    auto = {"chunking_strategy": "auto"}
    assert post(stt_engine, silence, PLUGIN, **auto).json()["text"] == ""
    assert post(stt_engine, silence, PLUGIN, response_format="text", **auto).text.strip() == ""
    doc = post(stt_engine, silence, PLUGIN, response_format="verbose_json", **auto).json()
    assert doc["text"] == "" and doc["segments"] == [] and doc["duration"] == pytest.approx(5, abs=0.05)
    assert post(stt_engine, silence, PLUGIN, response_format="srt", **auto).text == ""
    assert post(stt_engine, silence, PLUGIN, response_format="vtt", **auto).text == "WEBVTT\n\n"
    assert engine_requests(stt_engine) == before  # the engine never ran
    audio = long_clip[0]
    doc = post(stt_engine, audio, PLUGIN, response_format="verbose_json", **auto).json()
    expected = words(post(stt_engine, audio, PLUGIN, response_format="json", **auto).json()["text"])
    assert words(doc["text"]) == expected and words(" ".join(s["text"] for s in doc["segments"])) == expected
    assert all(0 <= s["start"] <= s["end"] <= doc["duration"] for s in doc["segments"])
    for s in doc["segments"]:  # each segment overlaps some spoken sentence of the clip
        assert any(s["start"] < b and s["end"] > a for a, b in long_clip[2]), s


@pytest.fixture(scope="module")
def hard_clips(clips, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Deterministic clips from the first sentence: as spoken; after 20 s of silence; under white noise (sigma
    0.1: the decode unsure); white noise alone (sigma 0.05, 8 s)."""
    import numpy as np
    import soundfile

    out = tmp_path_factory.mktemp("hard")
    speech_audio, rate = soundfile.read(clips[0][0], dtype="float32")
    rng = np.random.default_rng(0)
    noisy = np.clip(speech_audio + rng.standard_normal(len(speech_audio)).astype(np.float32) * 0.1, -1, 1)
    made = {
        "speech": speech_audio,
        "quiet": np.concatenate([np.zeros(20 * rate, np.float32), speech_audio]),
        "noisy": noisy,
        "noise": rng.standard_normal(8 * rate).astype(np.float32) * 0.05,
    }
    paths = {}
    for name, audio in made.items():
        paths[name] = out / f"{name}.wav"
        soundfile.write(paths[name], audio, rate, subtype="PCM_16")
    return paths


def test_no_speech_prob_is_openai_whispers(stt_engine, whisper_model, hard_clips):
    """verbose_json's no_speech_prob: the <|nospeech|> (<|nocaptions|>) probability after <|startoftranscript|>,
    from the alignment's encoder pass, against transformers' Whisper (float32) on the same weights and features:
    equal within the engine's bfloat16 rounding; high for noise, low for speech."""
    import soundfile
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(whisper_model).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(whisper_model)
    tokenizer = AutoTokenizer.from_pretrained(whisper_model)
    sot, no_speech = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|nocaptions|>"])
    ours = {}
    for name in ("speech", "quiet", "noise"):
        doc = post(stt_engine, hard_clips[name], PLUGIN, response_format="verbose_json").json()
        assert doc["segments"], (name, doc)  # each decodes to some text, so it has segments to carry the figure
        assert len({s["no_speech_prob"] for s in doc["segments"]}) == 1  # one window: one figure
        ours[name] = doc["segments"][0]["no_speech_prob"]
        audio, rate = soundfile.read(hard_clips[name], dtype="float32")
        features = extractor(audio, sampling_rate=rate, return_tensors="pt").input_features
        with torch.no_grad():
            logits = model(input_features=features, decoder_input_ids=torch.tensor([[sot]])).logits
        reference = float(torch.softmax(logits[0, -1].float(), dim=-1)[no_speech])
        assert ours[name] == pytest.approx(reference, abs=0.02), (name, ours[name], reference)
    assert ours["speech"] < 0.1 < ours["quiet"] < 0.6 < ours["noise"], ours


@pytest.fixture(scope="module")
def guarded_engine(whisper_model: Path, patched_vllm: Path, logs_dir: Path):
    """Whisper's guards on, at openai-whisper's values."""
    env = {"MMCPU_STT_NO_SPEECH_THRESHOLD": "0.6", "MMCPU_STT_TEMPERATURE_FALLBACK": "0.2,0.4,0.6,0.8,1.0"}
    engine = test_engine(whisper_model, logs_dir, "stt-guards", env=env).start()
    yield engine
    assert_native_then_stop(engine)


def guard_lines(engine, since: int) -> list[str]:
    return [line.split("] ", 1)[-1] for line in engine.log().splitlines() if "mmcpu.stt window" in line][since:]


def test_guards_fall_back_and_drop_silence(guarded_engine, stt_engine, hard_clips):
    """With the guards on: a confident decode is untouched (the same text as without them, no retry); an unsure
    one (speech under noise) is decoded again at rising temperatures, and its segments say which one was kept;
    noise whose <|nospeech|> is likely and whose decode is unsure is silence: no text, and no retry."""
    seen = len(guard_lines(guarded_engine, 0))
    plain = post(stt_engine, hard_clips["speech"], PLUGIN).json()["text"]
    assert post(guarded_engine, hard_clips["speech"], PLUGIN, seed="1").json()["text"] == plain
    assert guard_lines(guarded_engine, seen) == []

    doc = post(guarded_engine, hard_clips["noisy"], PLUGIN, response_format="verbose_json", seed="1").json()
    retries = guard_lines(guarded_engine, seen)
    assert retries and retries[0] == "mmcpu.stt window 0: logprob, decoded again at temperature 0.2", retries
    kept = float(retries[-1].rsplit(" ", 1)[1])
    assert doc["segments"] and {s["temperature"] for s in doc["segments"]} == {kept}, doc

    seen = len(guard_lines(guarded_engine, 0))
    assert post(guarded_engine, hard_clips["noise"], PLUGIN, seed="1").json()["text"] == ""
    [line] = guard_lines(guarded_engine, seen)
    assert line.startswith("mmcpu.stt window 0: no speech (p=") and line.endswith("its text dropped"), line
    assert post(stt_engine, hard_clips["noise"], PLUGIN).json()["text"].strip()  # without the guard: a hallucination
