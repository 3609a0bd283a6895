"""The shared response checks used by tests, smoke and benchmarks must reject what is wrong."""

from __future__ import annotations

import pytest

from mmcpu.checks import CheckFailed, openai_error_body, subtitle_text
from mmcpu.payloads import image_chat_kwargs, test_image, transcription_kwargs

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
