"""Whisper's log-mel features: transformers' extractor against mmcpu.features' trimmed one, per clip length and
torch thread count (the API server computes them for every request; docs/bench/host-work.md).

    python -m mmcpu_dev.bench.features [--lengths 1,5,15,30] [--threads 1,2] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.whisper import feature_extraction_whisper

from mmcpu import cpu, features
from mmcpu.config import get_settings


def timings(fn, extractor, x: np.ndarray, repeat: int) -> list[float]:
    fn(extractor, x, "cpu")
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(extractor, x, "cpu")
        out.append((time.perf_counter() - t) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench.features", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1,5,15,30", help="clip lengths in seconds")
    ap.add_argument("--threads", default="1,2", help="torch intra-op threads")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    extractor = WhisperFeatureExtractor.from_pretrained(get_settings().models_dir / "whisper-tiny.en")
    original = getattr(feature_extraction_whisper.WhisperFeatureExtractor, features.ATTRIBUTE)
    original = getattr(original, "__wrapped__", original)
    trimmed = features.trimmed(original)
    rng = np.random.default_rng(0)
    print("CPU:", cpu.current().line(), "- 1-minute load average", open("/proc/loadavg").read().split()[0])
    print("| clip (s) | threads | transformers p50 / min (ms) | trimmed p50 / min (ms) |")
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for seconds in (float(s) for s in args.lengths.split(",")):
            x = np.zeros(30 * 16000, dtype=np.float32)
            n = int(seconds * 16000)
            x[:n] = (rng.standard_normal(n) * 0.1).astype(np.float32)
            a, b = timings(original, extractor, x, args.repeat), timings(trimmed, extractor, x, args.repeat)
            print(
                f"| {seconds:g} | {threads} | {statistics.median(a):.1f} / {min(a):.1f} "
                f"| {statistics.median(b):.1f} / {min(b):.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
