"""Statistics of timed requests: percentiles, throughput, ratios and the pooling of repeated rounds. Pure
functions over plain data, unit-tested without servers; no timing is asserted anywhere."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def throughput(audio_s: float, wall_s: float) -> float | None:
    """Seconds of audio transcribed per second of wall time (real-time factor inverse); None if no time passed."""
    if wall_s <= 0:
        return None
    return audio_s / wall_s


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either is missing or the peer is 0 (a ratio that cannot be formed)."""
    if ours is None or peer is None or peer == 0 or math.isnan(ours) or math.isnan(peer):
        return None
    return ours / peer


def wer(samples: Sequence[Sample]) -> float | None:
    """Word error rate over the successful transcriptions that have a reference (None: none had one)."""
    from mmcpu_dev import speech

    ok = [s for s in samples if s.ok and s.ref is not None]
    return speech.word_error_rate([s.ref for s in ok], [s.text or "" for s in ok]) if ok else None


@dataclass
class Sample:
    """One timed request: latency, the audio seconds it carried (0 for vision), the text or the error."""

    latency_s: float
    audio_s: float = 0.0
    text: str | None = None
    error: str | None = None
    kind: str = ""  # e.g. "audio" / "vision" in the mixed load
    ref: str | None = None  # reference transcript (audio)

    @property
    def ok(self) -> bool:
        return self.error is None


class LevelStats(BaseModel):
    """The figures of one or more rounds at one concurrency (rounds pooled: walls add up, samples pool)."""

    concurrency: int | None = None
    n: int = 0
    ok: int = 0
    failures: int = 0
    wall_s: float = 0.0
    audio_s: float = 0.0
    throughput: float | None = None  # audio s per wall s
    rps: float | None = None
    p50_s: float | None = None
    p95_s: float | None = None
    mean_s: float | None = None
    max_s: float | None = None
    wer: float | None = None
    errors: list[tuple[str, int]] = []
    rounds: int = 1
    # min and max over repeated rounds, so one lucky or unlucky round cannot pass for the figure
    throughput_spread: tuple[float, float] | None = None
    rps_spread: tuple[float, float] | None = None
    p50_s_spread: tuple[float, float] | None = None
    rtf: float | None = None  # long files: wall / audio (< 1 = faster than real time)


@dataclass
class Round:
    """Requests sent together at one concurrency; wall time from the first send to the last answer."""

    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> LevelStats:
        return summarize(self.samples, self.wall_s, self.concurrency)


def summarize(samples: Sequence[Sample], wall_s: float, concurrency: int | None = None) -> LevelStats:
    """Counts, latency percentiles of the successful requests, throughput, rps and WER of one round."""
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok]
    audio_s = sum(s.audio_s for s in ok)
    errors = [s.error for s in samples if s.error is not None]
    return LevelStats(
        concurrency=concurrency,
        n=len(samples),
        ok=len(ok),
        failures=len(errors),
        wall_s=wall_s,
        audio_s=audio_s,
        throughput=throughput(audio_s, wall_s) if audio_s else None,
        rps=len(ok) / wall_s if wall_s > 0 else None,
        p50_s=percentile(lat, 50),
        p95_s=percentile(lat, 95),
        mean_s=sum(lat) / len(lat) if lat else None,
        max_s=max(lat) if lat else None,
        wer=wer(samples) if any(s.ref for s in samples) else None,
        errors=sorted(Counter(errors).items(), key=lambda kv: -kv[1])[:3],
    )


def merge_rounds(rounds: Iterable[Round]) -> LevelStats:
    """Several rounds at the SAME concurrency (e.g. repetitions) as one: walls add up, samples pool."""
    rounds = list(rounds)
    if not rounds:
        raise ValueError("no rounds to merge")
    levels = {r.concurrency for r in rounds}
    if len(levels) != 1:
        raise ValueError(f"rounds of different concurrency cannot be merged: {sorted(levels)}")
    merged = summarize([s for r in rounds for s in r.samples], sum(r.wall_s for r in rounds), levels.pop())
    merged.rounds = len(rounds)
    per_round = [r.summary() for r in rounds]
    for key in ("throughput", "rps", "p50_s"):
        values = [v for v in (getattr(s, key) for s in per_round) if v is not None]
        setattr(merged, f"{key}_spread", (min(values), max(values)) if values else None)
    merged.rtf = ratio(1.0, merged.throughput)
    return merged
