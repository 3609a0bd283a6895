"""The smoke check's subtitle validators: they must accept OpenAI-style SRT / WebVTT and reject broken bodies."""

from __future__ import annotations

import pytest

from mmcpu.checks import CheckFailed
from mmcpu.smoke import parse_srt, parse_vtt

SRT = "1\n00:00:00,000 --> 00:00:02,480\nThe quick brown fox\n\n2\n00:00:02,480 --> 00:00:04,000\njumps.\n\n"
VTT = "WEBVTT\n\n00:00:00.000 --> 00:00:02.480\nThe quick brown fox\n\n00:02.480 --> 00:04.000\njumps.\n"


def test_srt_parsed():
    cues = parse_srt(SRT)
    assert [(c.start, c.end, c.text) for c in cues] == [(0.0, 2.48, "The quick brown fox"), (2.48, 4.0, "jumps.")]


def test_vtt_parsed_with_and_without_hours():
    cues = parse_vtt(VTT)
    assert [(c.start, c.end, c.text) for c in cues] == [(0.0, 2.48, "The quick brown fox"), (2.48, 4.0, "jumps.")]


@pytest.mark.parametrize(
    "body",
    [
        "",
        '{"text": "The quick brown fox"}',
        "The quick brown fox",
        "1\n00:00:00.000 --> 00:00:02.480\ncomma expected\n",  # VTT-style time in SRT
        "2\n00:00:00,000 --> 00:00:02,480\nwrong index\n",
        "1\n00:00:03,000 --> 00:00:02,000\nends before it starts\n",
        "1\n00:00:00,000 --> 00:00:02,000\n\n",  # no text
    ],
)
def test_bad_srt_rejected(body):
    with pytest.raises(CheckFailed):
        parse_srt(body)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "1\n00:00:00,000 --> 00:00:02,480\nSRT, not VTT\n",
        "WEBVTT\n",  # no cues
        "WEBVTT\n\n00:00:00,000 --> 00:00:02,480\ncomma instead of dot\n",
        "WEBVTT\n\n00:00:05.000 --> 00:00:06.000\nlate\n\n00:00:01.000 --> 00:00:02.000\nout of order\n",
    ],
)
def test_bad_vtt_rejected(body):
    with pytest.raises(CheckFailed):
        parse_vtt(body)
