#!/usr/bin/env python3
"""The benchmark's helpers that run in the BENCH venv (.cache/bench-venv, requirements-bench.txt), not in the
runtime venv: faster-whisper's dependencies (ctranslate2, onnxruntime, av, a newer protobuf) and matplotlib
stay out of the runtime's pins. ``scripts/bench.py`` starts these as subprocesses; nothing here imports mmcpu.

    bench_peer.py fw --model CT2_DIR --compute-type int8|float32
        faster-whisper in this process. Prints {"ready": ...} once the model is loaded, then answers one JSON
        line per command read from stdin:
          {"op": "run", "files": [...], "concurrency": N, "warmup": bool} -> {"wall_s", "results": [...]}
          {"op": "quit"}
    bench_peer.py plot --json RESULTS --out PNG
        throughput vs concurrency per system (log scale: the systems differ by orders of magnitude).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def serve_fw(model_dir: Path, compute_type: str) -> int:
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr

    import ctranslate2
    import faster_whisper
    from faster_whisper import WhisperModel

    state: dict = {}

    def model_for(concurrency: int) -> WhisperModel:
        # faster-whisper's way to serve N concurrent calls: num_workers=N model replicas; the cores are split
        # between them so that N in flight do not oversubscribe the CPU.
        threads = max(1, _cpus() // concurrency)
        key = (concurrency, threads)
        if state.get("key") != key:
            state.pop("model", None)
            state["model"] = WhisperModel(
                str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=concurrency
            )
            state["key"] = key
        return state["model"]

    def transcribe(model: WhisperModel, path: str) -> str:
        # The same decoding as vLLM's transcription endpoint: greedy, no timestamps, no temperature fallback.
        segments, _info = model.transcribe(
            path, language="en", beam_size=1, temperature=0.0, without_timestamps=True,
            condition_on_previous_text=False, vad_filter=False,
        )  # fmt: skip
        return "".join(s.text for s in segments).strip()

    def timed(model: WhisperModel, path: str) -> dict:
        t0 = time.perf_counter()
        try:
            text = transcribe(model, path)
            return {"latency_s": time.perf_counter() - t0, "text": text, "error": None}
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
            return {"latency_s": time.perf_counter() - t0, "text": None, "error": f"{type(exc).__name__}: {exc}"}

    model_for(1)
    proto.write(json.dumps({
        "ready": True, "pid": os.getpid(), "compute_type": compute_type, "cpus": _cpus(),
        "versions": {"faster-whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__},
    }) + "\n")  # fmt: skip
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] != "run":
            proto.write(json.dumps({"error": f"unknown op {req['op']!r}"}) + "\n")
            continue
        conc = int(req["concurrency"])
        model = model_for(conc)
        if req.get("warmup"):
            transcribe(model, req["files"][0])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=conc) as pool:
            results = list(pool.map(lambda f: timed(model, f), req["files"]))
        wall = time.perf_counter() - t0
        threads = state["key"][1]
        proto.write(json.dumps({"wall_s": wall, "results": results, "cpu_threads": threads}) + "\n")
    return 0


def plot(results_path: Path, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    markers = iter("osD^v<>")
    for key, data in results.get("audio", {}).items():
        levels = sorted((int(c), r["throughput"]) for c, r in data.get("levels", {}).items() if r.get("throughput"))
        if not levels:
            continue
        label = results.get("systems", {}).get(key, {}).get("label", key)
        ax.plot([c for c, _ in levels], [t for _, t in levels], marker=next(markers, "o"), label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    conc = sorted({int(c) for d in results.get("audio", {}).values() for c in d.get("levels", {})})
    if conc:
        ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput (audio seconds / wall second, log)")
    meta = results.get("meta", {})
    ax.set_title(f"Whisper tiny.en on {meta.get('cpus', '?')} CPUs (load avg {meta.get('loadavg_start', '?')})\n"
                 "each level has its own clip mix: compare systems within a level", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fw = sub.add_parser("fw", help="serve faster-whisper over stdin/stdout")
    fw.add_argument("--model", type=Path, required=True, help="CTranslate2 model folder")
    fw.add_argument("--compute-type", required=True, choices=["int8", "float32", "int8_float32", "float16"])
    pl = sub.add_parser("plot", help="throughput vs concurrency PNG")
    pl.add_argument("--json", type=Path, required=True)
    pl.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "fw":
        if not (args.model / "model.bin").is_file():
            print(f"error: {args.model} has no model.bin", file=sys.stderr)
            return 2
        return serve_fw(args.model, args.compute_type)
    return plot(args.json, args.out)


if __name__ == "__main__":
    sys.exit(main())
