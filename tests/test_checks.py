"""The shared response checks used by tests, smoke and benchmarks must reject what is wrong."""

from __future__ import annotations

import pytest

from mmcpu_dev import payloads
from mmcpu_dev.checks import CheckFailed, openai_error_body, subtitle_text
from mmcpu_dev.payloads import image_chat_kwargs, test_image, transcription_kwargs

SRT = "1\n00:00:00,000 --> 00:00:02,500\nhello there\n\n2\n00:00:02,500 --> 00:00:03,000\nbye\n"
VTT = "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nhello there\n"


def test_subtitles_valid():
    assert subtitle_text(SRT, "srt") == "hello there bye"
    assert subtitle_text(VTT, "vtt") == "hello there"


@pytest.mark.parametrize(
    "document,fmt",
    [
        (SRT.replace("2\n", "3\n", 1), "srt"),  # numbering
        (SRT.replace("-->", "->", 1), "srt"),  # arrow
        ("1\n00:00:03,000 --> 00:00:01,000\nback\n", "srt"),  # ends before it starts
        (VTT.replace("WEBVTT", "WEBVTX"), "vtt"),  # header
        (VTT.replace(".500", ",500"), "vtt"),  # srt-style decimal in vtt
        ('{"text": "json, not subtitles"}', "srt"),
    ],
)
def test_subtitles_malformed(document, fmt):
    with pytest.raises(CheckFailed):
        subtitle_text(document, fmt)


def test_openai_error_body():
    body = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    assert openai_error_body(body)["message"] == "bad"
    for bad in ({"detail": "x"}, {"error": "x"}, {"error": {"type": "X"}}, {"error": {"message": "m"}}, "text"):
        with pytest.raises(CheckFailed):
            openai_error_body(bad)


def test_payload_builders():
    kwargs = transcription_kwargs(b"RIFF", model="m")
    assert "language" not in kwargs and kwargs["file"][1] == b"RIFF"
    assert transcription_kwargs(b"x", model="m", language="en")["language"] == "en"
    chat = image_chat_kwargs([test_image(1), test_image(2), "data:image/png;base64,AAAA"], model="m")
    parts = chat["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "image_url", "text"]
    assert parts[0]["image_url"]["url"] != parts[1]["image_url"]["url"]  # seeds give different pictures
    assert parts[2]["image_url"]["url"] == "data:image/png;base64,AAAA"
    assert test_image(1).tobytes() == test_image(1).tobytes()


def test_openai_error_body_strict():
    full = {"error": {"message": "bad", "type": "BadRequestError", "param": "temperature", "code": 400}}
    assert openai_error_body(full, strict=True)["param"] == "temperature"
    no_param = {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}
    assert openai_error_body(no_param)["message"] == "bad"  # the lenient check stays lenient
    for bad in (no_param, {"error": {**full["error"], "code": [400]}}, {"error": {**full["error"], "param": 1}}):
        with pytest.raises(CheckFailed):
            openai_error_body(bad, strict=True)


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3"])
def test_audio_file_decodes_back(fmt):
    import io

    import soundfile

    data = payloads.audio_file(1.5, fmt)
    samples, rate = soundfile.read(io.BytesIO(data))
    assert rate == 16000 and abs(len(samples) / rate - 1.5) < 0.1  # mp3 pads a frame or two
    assert len(payloads.audio_file(0.0, "wav")) == 44  # header only: the zero-length case


def test_declared_image_sizes():
    import io

    from PIL import Image

    assert Image.open(io.BytesIO(payloads.png_declaring(300, 200))).size == (300, 200)
    assert Image.open(io.BytesIO(payloads.jpeg_declaring(1234, 567))).size == (1234, 567)
    assert len(payloads.png_declaring(30000, 30000)) < 100  # a bomb is small on the wire


def test_raw_multipart_is_parseable():
    from email.parser import BytesParser
    from email.policy import HTTP

    req = payloads.raw_multipart(
        "/v1/audio/transcriptions", {"model": "m"}, {"file": ("a.wav", b"RIFF\r\n", "audio/wav")}
    )
    msg = BytesParser(policy=HTTP).parsebytes(
        f"Content-Type: {req.headers['Content-Type']}\r\n\r\n".encode() + req.body
    )
    parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
    assert parts["model"].get_content().strip() == "m"
    assert parts["file"].get_filename() == "a.wav" and parts["file"].get_payload(decode=True) == b"RIFF\r\n"
    assert payloads.raw_multipart("/x", {"model": "m"}).body == payloads.raw_multipart("/x", {"model": "m"}).body


def test_hard_input_catalogue():
    from mmcpu_dev import hard_inputs

    names = [c.name for c in hard_inputs.CASES]
    assert len(names) >= 100 and len(set(names)) == len(names)
    for case in hard_inputs.CASES:
        # A 4xx, or a bounded answer (200: served, the engine unharmed) - never a 5xx.
        assert (400 <= case.status < 500 or case.status == 200) and case.endpoint.startswith("/v1/") and case.why
        assert case.pending is None or case.pending in hard_inputs.PENDING
        request = case.build("some-model")
        assert isinstance(request, (hard_inputs.OpenAICall, payloads.RawRequest, hard_inputs.SlowBody))
    required = {
        "decompression-bomb-png",
        "huge-dimensions-jpeg",
        "too-many-images",
        "audio-too-long",
        "truncated-mp3",
        "truncated-ogg",
        "truncated-flac",
        "zero-length-audio",
        "model-not-a-string",
        "wrong-content-type-audio",
        "multipart-without-file",
        "invalid-response-format",
        "temperature-above-range-chat",
        "n-zero",
        "malformed-image-url",
        "unsupported-url-scheme",
    }
    assert required <= set(names)


def test_hard_input_judge():
    from mmcpu_dev import hard_inputs

    case = hard_inputs.by_name("n-zero")
    good = {"error": {"message": "n must be at least 1", "type": "BadRequestError", "param": None, "code": 400}}
    assert hard_inputs.judge(case, 400, good)[0]
    assert not hard_inputs.judge(case, 500, good)[0]  # a 500 is never the answer
    assert not hard_inputs.judge(case, None, "ConnectError")[0]  # a dead engine neither
    assert not hard_inputs.judge(case, 400, {"detail": "FastAPI's own shape"})[0]
    assert not hard_inputs.judge(case, 400, {"error": {"message": "m", "type": "T"}})[0]  # no param/code
    assert hard_inputs.judge(hard_inputs.ALIVE["vision"], 200, {"choices": []})[0]
