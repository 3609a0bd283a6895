"""Segments from one timestamped decode or from aligned words, and the text / srt / vtt renderings (pure functions,
no vLLM)."""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmcpu.stt import guards

# Whisper's timestamp tokens are 20 ms apart (<|0.00|>, <|0.02|>, ...).
TIMESTAMP_STEP_S = 0.02


@dataclass
class Segment:
    start: float
    end: float
    text: str
    tokens: list[int]
    avg_logprob: float
    seek: int  # openai-whisper's seek: the window's start in mel frames (100 per second)
    no_speech_prob: float | None = None  # its window's, from the alignment's encoder pass (None: not computed)
    temperature: float | None = None  # its window's decode, when the fallback raised it (None: the request's)

    def as_openai(self, number: int, temperature: float) -> dict[str, Any]:
        return {
            "id": number,
            "seek": self.seek,
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "tokens": self.tokens,
            "temperature": temperature if self.temperature is None else self.temperature,
            "avg_logprob": self.avg_logprob,
            # A high ratio (repetitive text) hints at a hallucination loop, as in openai-whisper.
            "compression_ratio": guards.compression_ratio(self.text),
            "no_speech_prob": self.no_speech_prob,
        }


def window_segments(
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    decode: Callable[[list[int]], str],
    *,
    timestamp_begin: int,
    eot: int,
    window_start: float,
    window_end: float,
) -> list[Segment]:
    """The segments of one window's timestamped decode: each text run between timestamps goes from the timestamp
    before it to the one after it. Text after the last timestamp (the speech runs on past the window, or the tokens
    ran out) ends at the window's end, so every decoded word is kept. Times are clamped to the window."""

    def clamp(t: float) -> float:
        return round(min(max(t, window_start), window_end), 3)

    segments: list[Segment] = []
    opened: float | None = None  # the running segment's start timestamp
    last_end = window_start
    text: list[int] = []
    scores: list[float] = []

    def close(end: float) -> None:
        nonlocal text, scores
        words = decode(text)
        if words.strip():
            start = clamp(last_end if opened is None else opened)
            segments.append(
                Segment(
                    start,
                    max(clamp(end), start),
                    words,
                    list(text),
                    sum(scores) / max(1, len(scores)),
                    round(window_start * 100),
                )
            )
        text, scores = [], []

    for i, token in enumerate(tokens):
        if token == eot:
            break
        score = logprobs[i] if i < len(logprobs) else None
        if token >= timestamp_begin:
            t = window_start + TIMESTAMP_STEP_S * (token - timestamp_begin)
            if text:
                if score is not None:
                    scores.append(score)
                close(t)
                last_end, opened = clamp(t), None
            else:
                opened = t
        elif token < eot:  # text; other specials (none expected after the prompt) are not words
            text.append(token)
            if score is not None:
                scores.append(score)
    if text:
        close(window_end)
    return segments


# How segments are cut from a window's aligned words (MMCPU_STT_TIMESTAMPS=align), as Whisper's own segments tend to
# fall: after a sentence-final mark, at a pause between words, and before a segment would outgrow Whisper's usual
# segment length.
SENTENCE_FINAL = tuple(".!?。！？")
SEGMENT_PAUSE_S = 0.8
SEGMENT_MAX_S = 12.0


def _punctuation(text: str) -> bool:
    return not text.strip().strip(string.punctuation + "。，！？、：”“")


def trim_pauses(words: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Pauses back between aligned words. DTW gives every audio frame to some token, so a silence between two words
    is absorbed by the words beside it, which run long ("over-long": beyond openai-whisper's ``longest``, twice the
    median word, the median at most 0.7 s). Where both neighbours are over-long and together last more than twice
    ``longest`` plus ``SEGMENT_PAUSE_S``, each is cut to ``longest`` on the side of the pause; a lone word longer
    than ``longest`` plus ``SEGMENT_PAUSE_S`` beside a word of normal length is cut at its end (the alignment stays
    on a word through the silence after it). Punctuation after a word is left to the word (a sentence's end is
    Whisper's own cut, :func:`mmcpu.whisper_align.cut_long_words`)."""
    durations = sorted(end - start for _, start, end in words if end > start)
    if not durations:
        return list(words)
    longest = 2 * min(0.7, durations[len(durations) // 2])
    starts = [start for _, start, _ in words]
    ends = [end for _, _, end in words]
    for i in range(len(words) - 1):
        if _punctuation(words[i + 1][0]):
            continue
        da, db = ends[i] - starts[i], ends[i + 1] - starts[i + 1]
        if da > longest and db > longest and da + db > 2 * longest + SEGMENT_PAUSE_S:
            ends[i], starts[i + 1] = starts[i] + longest, ends[i + 1] - longest
        elif da > longest + SEGMENT_PAUSE_S and db <= longest:
            ends[i] = starts[i] + longest
    return [(w[0], a, b) for w, a, b in zip(words, starts, ends, strict=True)]


def group_words(words: Sequence[tuple[str, float, float]]) -> list[range]:
    """Segments as ranges of ``words`` (text, start, end; in order, times in seconds): a new segment starts after
    a word whose text ends a sentence (``SENTENCE_FINAL``), where a word starts ``SEGMENT_PAUSE_S`` or more after
    the previous one ended, and at a word that would make the segment longer than ``SEGMENT_MAX_S``; never at
    punctuation (it stays with the word before it). A segment always keeps its first word: no word is dropped."""
    out: list[range] = []
    first = 0
    for i in range(1, len(words)):
        text, start, end = words[i]
        previous = words[i - 1]
        if _punctuation(text):
            continue
        if (
            previous[0].rstrip().endswith(SENTENCE_FINAL)
            or start - previous[2] >= SEGMENT_PAUSE_S
            or end - words[first][1] > SEGMENT_MAX_S
        ):
            out.append(range(first, i))
            first = i
    if words:
        out.append(range(first, len(words)))
    return out


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


_SPACE = re.compile(r"\s+")


def cue_text(text: str, fmt: str) -> str:
    """One cue's text on one line: a blank line would end the cue, ``-->`` would read as a timing line, and in
    WebVTT ``<``, ``>`` and ``&`` would read as markup."""
    line = _SPACE.sub(" ", text).strip().replace("-->", "->")
    if fmt == "vtt":
        line = line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return line


def subtitles(segments: Sequence[Segment], fmt: str) -> str:
    """SRT or WebVTT from the segments; segments with no text make no cue (silence gives an empty document, not an
    empty cue)."""
    cues = [(s.start, s.end, cue_text(s.text, fmt)) for s in segments]
    cues = [c for c in cues if c[2]]
    if fmt == "srt":
        return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t}\n\n" for i, (a, b, t) in enumerate(cues, 1))
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{t}\n\n" for a, b, t in cues)
