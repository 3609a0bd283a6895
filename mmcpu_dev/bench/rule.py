"""The rule a measured row of mmcpu/cpu_defaults.json is picked by (``python -m mmcpu_dev.bench defaults``); the
runtime (mmcpu.defaults) only reads the table it wrote."""

from __future__ import annotations

import math

from mmcpu.defaults import Candidate, Choice

# The audio role may trade this much WER (absolute) against float32 for speed.
WER_SLACK = 0.02
TIE = 0.05  # throughput differences this small are within a 2-CPU machine's noise (docs/bench/host-work.md: ±4 %)


def score(candidate: Candidate) -> float:
    """Geometric mean over the levels: one fast level must not hide a slow one."""
    vals = list(candidate.throughput.values())
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals and min(vals) > 0 else 0.0


def memory_rank(choice: Choice) -> tuple[int, int]:
    """Smaller first: bytes per weight, then per activation / KV cache entry (int8 + bf16 < bf16 < int8 + float32
    < float32)."""
    act = 4 if choice.dtype == "float32" else 2
    return (1 if choice.quantization == "int8" else act), act


def pick(role: str, candidates: list[Candidate]) -> Choice:
    """The rule of every measured row. Audio: only candidates whose WER is within WER_SLACK of float32's
    unquantised (the reference); vision: all (its fixture has random weights: no quality to compare). Then the
    fastest, except that a candidate within TIE of the fastest and lighter in memory wins: a real model served in
    bf16 needs half the weights and KV cache (llava-smollm2's 8k context does not fit the default 0.25 GiB KV cache
    in float32). A candidate that failed (``error``) is never picked."""
    candidates = [c for c in candidates if c.error is None]
    if role == "audio":
        ref = next(c for c in candidates if c.choice == Choice(dtype="float32"))
        candidates = [
            c for c in candidates if c.wer is not None and ref.wer is not None and c.wer <= ref.wer + WER_SLACK + 1e-9
        ]
    best = max(score(c) for c in candidates)
    near = [c for c in candidates if score(c) >= best * (1 - TIE)]
    return min(near, key=lambda c: (memory_rank(c.choice), -score(c))).choice
