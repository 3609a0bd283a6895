"""The benchmark's part that runs in the BENCH venv (.cache/bench-venv, requirements-bench.txt), not in the
runtime venv: faster-whisper's dependencies (ctranslate2, onnxruntime, av, a newer protobuf) and matplotlib stay
out of the runtime's pins. The benchmark runs this file by its path with that venv's python; it imports nothing
from mmcpu.

    python peer.py fw --model CT2_DIR --compute-type int8|float32
        faster-whisper in this process. Prints {"ready": ...} once loaded, then answers one JSON line per command:
          {"op": "run", "files": [...], "concurrency": N, "cpu_threads": T, "num_workers": W, "batch": B,
           "warmup": bool} -> {"wall_s", "results": [{"latency_s", "text", "error"}]}
            (B > 0: each file through BatchedInferencePipeline with batch_size B)
          {"op": "quit"}
    python peer.py plot --json RESULTS --out PNG
        audio throughput vs concurrency per system (the same requests at every level).
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
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    models: dict[tuple[int, int], WhisperModel] = {}

    def model_for(threads: int, workers: int) -> WhisperModel:
        # num_workers = model replicas that transcribe concurrently, each with cpu_threads threads.
        if (threads, workers) not in models:
            models[threads, workers] = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type,
                                                    cpu_threads=threads, num_workers=workers)
        return models[threads, workers]

    def transcribe(model: WhisperModel, path: str, batch: int) -> str:
        # The same decoding as vLLM's transcription endpoint: greedy, no timestamps, no temperature fallback.
        opts = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True)
        if batch:  # its documented long-file mode: VAD cuts the file into <= 30 s chunks, decoded in batches
            segments, _ = BatchedInferencePipeline(model).transcribe(path, batch_size=batch, **opts)
        else:
            segments, _ = model.transcribe(path, condition_on_previous_text=False, vad_filter=False, **opts)
        return "".join(s.text for s in segments).strip()

    def timed(model: WhisperModel, path: str, batch: int) -> dict:
        t0 = time.perf_counter()
        try:
            text = transcribe(model, path, batch)
            return {"latency_s": time.perf_counter() - t0, "text": text, "error": None}
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
            return {"latency_s": time.perf_counter() - t0, "text": None, "error": f"{type(exc).__name__}: {exc}"}

    model_for(1, 1)
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
        conc, batch = int(req["concurrency"]), int(req.get("batch") or 0)
        model = model_for(int(req["cpu_threads"]), int(req["num_workers"]))
        if req.get("warmup"):
            transcribe(model, req["files"][0], batch)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=conc) as pool:
            results = list(pool.map(lambda f: timed(model, f, batch), req["files"]))
        proto.write(json.dumps({"wall_s": time.perf_counter() - t0, "results": results}) + "\n")
    return 0


def plot(results_path: Path, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    markers = iter("osD^v<>px*")
    levels_seen = set()
    for system in results.get("systems", {}).values():
        points = sorted((int(c), r["throughput"]) for c, r in system.get("audio", {}).items() if r.get("throughput"))
        if not points:
            continue
        levels_seen |= {c for c, _ in points}
        ours = system["spec"].get("ours")
        ax.plot([c for c, _ in points], [t for _, t in points], marker=next(markers, "o"),
                linewidth=2.5 if ours else 1.2, label=system["spec"]["label"] + (" (ours)" if ours else ""))
    ax.set_xscale("log", base=2)
    if levels_seen:
        ax.set_xticks(sorted(levels_seen), [str(c) for c in sorted(levels_seen)])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput (audio seconds / wall second)")
    cpu, meta = results.get("cpu", {}), results.get("meta", {})
    n = len(results.get("plan", {}).get("requests", []))
    ax.set_title(f"{cpu.get('model', '?')} ({cpu.get('isa', '?')}), {cpu.get('cpus', '?')} CPUs, "
                 f"load {meta.get('loadavg_start', '?')}\nthe same {n} requests at every level", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
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
