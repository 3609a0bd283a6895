"""python -m mmcpu_dev.bench float32: float32 GEMM GFLOP/s per CPU path, Whisper's linear shapes, 2 threads.

Paths (each on the same randomised float32 inputs, weight [N, K] as checkpoints store it):

- ``F.linear``: ``torch.nn.functional.linear``, which torch 2.13+cpu sends to MKL's SGEMM (``MKL_VERBOSE=1``);
- ``onednn_mm``: vLLM's own CPU linear (``vllm._custom_ops.create_onednn_mm`` / ``onednn_mm``), what
  ``dispatch_cpu_unquantized_gemm`` installs for every float32 ``LinearBase`` and the LM head on x86 without
  AMX-specific kernels; oneDNN's ``brg_matmul`` (``ONEDNN_VERBOSE=all``);
- ``mkldnn_linear``: torch's own oneDNN linear (``torch.ops.mkldnn._linear_pointwise``).

Shapes: tiny.en (d_model 384, ffn 1536) and base (512, 2048); encoder M=1500 (one 30 s window), decoder M=1
and 8 (c=1, c=8 decode steps), the tied LM head (vocab). Each figure: best and median of ``--reps`` timed
batches (each ~``--min-s``), paths interleaved per batch so load drift hits all alike; the 1-minute load and the
CPU time other processes used during the run are printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SHAPES = {  # name: (M, K, N)
    "tiny enc qkv": (1500, 384, 1152),
    "tiny enc out": (1500, 384, 384),
    "tiny enc fc1": (1500, 384, 1536),
    "tiny enc fc2": (1500, 1536, 384),
    "tiny dec fc1 M=1": (1, 384, 1536),
    "tiny dec fc2 M=1": (1, 1536, 384),
    "tiny dec fc1 M=8": (8, 384, 1536),
    "tiny lm head M=1": (1, 384, 51864),
    "base enc qkv": (1500, 512, 1536),
    "base enc fc1": (1500, 512, 2048),
    "base enc fc2": (1500, 2048, 512),
    "base dec fc1 M=1": (1, 512, 2048),
    "base lm head M=1": (1, 512, 51865),
}


def paths(m: int, k: int, n: int, seed: int = 0) -> dict[str, object]:
    import torch
    import torch.nn.functional as F
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(s, generator=gen) for s in ((m, k), (n, k), (n,)))
    handler = ops.create_onednn_mm(w.t(), 32)  # as dispatch_cpu_unquantized_gemm: a [K, N] view of [N, K]
    fns = {"F.linear": lambda: F.linear(x, w, b), "onednn_mm": lambda: ops.onednn_mm(handler, x, b)}
    try:
        torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        fns["mkldnn_linear"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except (RuntimeError, AttributeError):
        pass
    return fns


def other_cpu_s() -> float:
    """CPU seconds used so far by every process but this one (from /proc/stat minus our own)."""
    fields = open("/proc/stat").readline().split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4)) / os.sysconf("SC_CLK_TCK")
    return busy - sum(os.times()[:2])


def measure(names: list[str], reps: int, min_s: float, threads: int, log=print) -> dict:
    import torch

    torch.set_num_threads(threads)
    out = {}
    for name in names:
        m, k, n = SHAPES[name]
        fns = paths(m, k, n)
        for fn in fns.values():
            fn(), fn()
        times = {p: [] for p in fns}
        for _ in range(reps):
            for p, fn in fns.items():
                count, t0 = 0, time.perf_counter()
                while True:
                    fn()
                    count += 1
                    if (el := time.perf_counter() - t0) >= min_s:
                        break
                times[p].append(el / count)
        flop = 2.0 * m * k * n
        out[name] = {
            p: {
                "best": round(flop / min(t) / 1e9, 1),
                "median": round(flop / statistics.median(t) / 1e9, 1),
                "ms": round(1e3 * statistics.median(t), 3),
            }
            for p, t in times.items()
        }
        log(
            f"{name:18} {m}x{k} @ {k}x{n}: "
            + ", ".join(f"{p} {v['median']} ({v['best']} best) GFLOP/s" for p, v in out[name].items())
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from mmcpu import cpu

    describe = lambda: cpu.current().line()  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench float32", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names (default: all)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-s", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print("CPU:", describe())
    load0, other0, t0 = os.getloadavg()[0], other_cpu_s(), time.monotonic()
    res = measure(args.shapes.split(","), args.reps, args.min_s, args.threads)
    others = (other_cpu_s() - other0) / (time.monotonic() - t0)
    print(f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}; other processes used {others:.2f} cores on average")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cpu": describe(),
                    "load": [load0, os.getloadavg()[0]],
                    "other_cores": round(others, 2),
                    "shapes": res,
                },
                indent=1,
            )
        )
    return 0
