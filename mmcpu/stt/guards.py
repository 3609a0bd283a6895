"""Whisper's guards against repetition loops and hallucinated silence, as openai-whisper (``transcribe.py``) and
faster-whisper apply them to each 30 s window's decode:

- **temperature fallback**: a decode whose text compresses too well (gzip ratio above
  ``compression_ratio_threshold``: the same phrase looping) or whose mean token logprob is below
  ``logprob_threshold`` is decoded again at the next temperature of the schedule, until one passes or the schedule
  ends (then the last decode stands);
- **no speech**: a window whose ``<|nospeech|>`` probability is above ``no_speech_threshold`` while its decode is
  not confident (mean logprob below ``logprob_threshold``) is taken as silence: no text.

Pure functions of a decode's text and logprobs, so the serving code and the tests share them."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass


def compression_ratio(text: str) -> float:
    """openai-whisper's ``compression_ratio``: UTF-8 bytes over their zlib-compressed size."""
    data = text.encode("utf-8")
    return len(data) / max(1, len(zlib.compress(data)))


def mean_logprob(logprobs: Sequence[float | None]) -> float:
    """openai-whisper's ``avg_logprob``: the sampled tokens' summed logprob over their count (its ``<|endoftext|>``
    included by the caller when it has one); 0 for no tokens."""
    known = [x for x in logprobs if x is not None]
    return sum(known) / len(known) if known else 0.0


@dataclass(frozen=True)
class Guards:
    """The thresholds (``None``: that check is off) and the temperature schedule after the request's own."""

    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = None
    fallback: tuple[float, ...] = ()  # temperatures tried after the request's, in order (empty: no fallback)

    def needs_fallback(self, text: str, logprobs: Sequence[float | None]) -> str | None:
        """Why this decode is retried at the next temperature (``"compression_ratio"`` / ``"logprob"``), or None."""
        if self.compression_ratio_threshold is not None and compression_ratio(text) > self.compression_ratio_threshold:
            return "compression_ratio"
        if self.logprob_threshold is not None and mean_logprob(logprobs) < self.logprob_threshold:
            return "logprob"
        return None

    def schedule(self, temperature: float) -> list[float]:
        """The temperatures a window is decoded at, in order: the request's, then the fallback's above it."""
        return [temperature, *(t for t in self.fallback if t > temperature)]

    def is_silence(self, no_speech_prob: float | None, logprobs: Sequence[float | None]) -> bool:
        """openai-whisper's skip: ``<|nospeech|>`` likely and the decode not confident."""
        if self.no_speech_threshold is None or no_speech_prob is None or no_speech_prob != no_speech_prob:
            return False
        if no_speech_prob <= self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or mean_logprob(logprobs) < self.logprob_threshold
