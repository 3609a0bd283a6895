"""Whisper's guards (mmcpu.stt.guards) against openai-whisper's own definitions: the compression ratio of
repeated text, the mean logprob, when a decode is retried at the next temperature and when a window is silence."""

from __future__ import annotations

import zlib

import pytest

from mmcpu.stt.guards import Guards, compression_ratio, mean_logprob


def test_compression_ratio_is_openai_whispers():
    text = "the same words again " * 12
    data = text.encode()
    assert compression_ratio(text) == len(data) / len(zlib.compress(data))
    assert compression_ratio(text) > 2.4  # a loop: what the fallback catches
    assert compression_ratio("The quick brown fox jumps over the lazy dog.") < 2.4
    assert compression_ratio("") == 0.0


def test_mean_logprob_ignores_unknown_and_is_zero_for_nothing():
    assert mean_logprob([-1.0, None, -3.0]) == -2.0
    assert mean_logprob([]) == 0.0


@pytest.mark.parametrize(
    ("text", "logprobs", "why"),
    [
        ("the same words again " * 12, [-0.1] * 10, "compression_ratio"),
        ("A plain sentence of speech.", [-1.5, -0.9], "logprob"),
        ("A plain sentence of speech.", [-0.2, -0.3], None),
    ],
)
def test_fallback_reasons(text, logprobs, why):
    assert Guards().needs_fallback(text, logprobs) == why


def test_thresholds_off_never_retry():
    off = Guards(compression_ratio_threshold=None, logprob_threshold=None)
    assert off.needs_fallback("loop " * 50, [-9.0]) is None


def test_schedule_starts_at_the_requests_temperature():
    guards = Guards(fallback=(0.2, 0.4, 0.6, 0.8, 1.0))
    assert guards.schedule(0.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert guards.schedule(0.5) == [0.5, 0.6, 0.8, 1.0]
    assert Guards().schedule(0.3) == [0.3]  # no fallback: the request's temperature only


def test_silence_needs_both_no_speech_and_low_confidence():
    guards = Guards(no_speech_threshold=0.6)
    assert guards.is_silence(0.9, [-1.4])
    assert not guards.is_silence(0.9, [-0.2])  # likely silence, but the decode is confident: kept
    assert not guards.is_silence(0.3, [-1.4])
    assert not guards.is_silence(None, [-1.4])
    assert not guards.is_silence(float("nan"), [-1.4])
    assert not Guards().is_silence(0.99, [-5.0])  # the no-speech check off
