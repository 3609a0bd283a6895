"""The benchmark's part that runs in a PEER's venv, not in the runtime venv, so no peer's dependencies move the
runtime's pins: faster-whisper and matplotlib in the bench venv (.cache/bench-venv, requirements-bench.txt),
OpenVINO GenAI and whisper.cpp (pywhispercpp) in their own (.cache/peers/NAME, mmcpu_dev/bench/peers.py). The
benchmark runs this file by its path with that venv's python; it imports nothing from mmcpu.

    python peer.py fw --model CT2_DIR --compute-type int8|float32      faster-whisper (CTranslate2)
    python peer.py ov --model IR_DIR                                    OpenVINO GenAI WhisperPipeline
    python peer.py wcpp --model GGML_BIN                                whisper.cpp through pywhispercpp
        one peer in this process. Prints {"ready": ...} once loaded, then answers one JSON line per command:
          {"op": "run", "files": [...], "concurrency": N, "cpu_threads": T, "num_workers": W, "batch": B,
           "warmup": bool} -> {"wall_s", "results": [{"latency_s", "text", "error"}]}
            num_workers = replicas transcribing concurrently, each with cpu_threads threads (faster-whisper: its
            own num_workers; OpenVINO, whisper.cpp: a pool of W pipelines / contexts). B > 0 (faster-whisper
            only): each file through BatchedInferencePipeline with batch_size B
          {"op": "quit"}
    python peer.py fw-ref --model CT2_DIR --compute-type int8|float32
        faster-whisper as the tests' reference (mmcpu_dev/reference.py): reads one JSON object
        {"files": [...], "options": {...transcribe() keywords}} from stdin, prints {"versions", "results": [{"text",
        "language", "duration", "segments": [{"id", "start", "end", "text", "words": [...] | null}]}]}.
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


def read_wav(path: str):
    """A 16-bit PCM WAV (the workload's clips) as float32 in [-1, 1]: the input OpenVINO and whisper.cpp take."""
    import wave

    import numpy as np

    with wave.open(path, "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1 or w.getframerate() != 16000:
            raise ValueError(f"{path}: want 16 kHz mono 16-bit PCM")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype("float32") / 32768.0


class Pool:
    """``workers`` replicas of a single-stream model; a call takes a free one (blocking) and gives it back."""

    def __init__(self, replicas: list) -> None:
        import queue

        self.free: queue.Queue = queue.Queue()
        for r in replicas:
            self.free.put(r)

    def __call__(self, fn):
        replica = self.free.get()
        try:
            return fn(replica)
        finally:
            self.free.put(replica)


def fw_backend(model_dir: Path, compute_type: str):
    import ctranslate2
    import faster_whisper
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    def load(threads: int, workers: int):
        # num_workers = model replicas that transcribe concurrently, each with cpu_threads threads.
        model = WhisperModel(
            str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=workers
        )

        def transcribe(path: str, batch: int) -> str:
            # The same decoding as vLLM's transcription endpoint: greedy, no timestamps, no temperature fallback.
            opts = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True)
            if batch:  # its documented long-file mode: VAD cuts the file into <= 30 s chunks, decoded in batches
                segments, _ = BatchedInferencePipeline(model).transcribe(path, batch_size=batch, **opts)
            else:
                segments, _ = model.transcribe(path, condition_on_previous_text=False, vad_filter=False, **opts)
            return "".join(s.text for s in segments).strip()

        return transcribe

    isa = os.environ.get("CT2_FORCE_CPU_ISA") or "default"
    return load, {"faster-whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__, "ct2_isa": isa}


def ov_config(threads: int, workers: int) -> dict[str, object]:
    """One replica's OpenVINO CPU properties. Pinning stays on for one replica and is off for several: pinned, two
    1-thread replicas ran no faster than one (int8 at c=4: 44.7 against 41.3 audio-s/s, AMD EPYC Zen 5, 2 CPUs), as
    if both sat on one core; unpinned, the OS spreads them. The bench records each round's cpu/wall to prove it."""
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if workers > 1:
        config["ENABLE_CPU_PINNING"] = False
    return config


def ov_backend(ir_dir: Path):
    import openvino
    import openvino_genai

    def load(threads: int, workers: int):
        # One WhisperPipeline per replica, each with its own inference threads (latency hint: one stream each).
        pool = Pool(
            [openvino_genai.WhisperPipeline(str(ir_dir), "CPU", **ov_config(threads, workers)) for _ in range(workers)]
        )

        def transcribe(path: str, batch: int) -> str:
            audio = read_wav(path)
            # greedy (num_beams 1), no timestamps, English; tiny.en has no language token
            return pool(
                lambda p: str(p.generate(audio, max_new_tokens=440, num_beams=1, return_timestamps=False))
            ).strip()

        return transcribe

    return load, {"openvino-genai": openvino_genai.__version__.split("-")[0], "openvino": openvino.__version__}


def wcpp_backend(ggml_bin: Path):
    from importlib import metadata

    from pywhispercpp.model import Model

    def load(threads: int, workers: int):
        pool = Pool(
            [
                Model(
                    str(ggml_bin),
                    n_threads=threads,
                    print_progress=False,
                    print_realtime=False,
                    redirect_whispercpp_logs_to=None,
                )
                for _ in range(workers)
            ]
        )
        # greedy, no timestamps, English, no temperature fallback (temperature_inc 0): as the others decode
        opts = dict(language="en", no_timestamps=True, temperature=0.0, temperature_inc=0.0, no_context=True)

        def transcribe(path: str, batch: int) -> str:
            audio = read_wav(path)
            return pool(lambda m: "".join(s.text for s in m.transcribe(audio, **opts))).strip()

        return transcribe

    return load, {"pywhispercpp": metadata.version("pywhispercpp")}


def fw_reference(model_dir: Path, compute_type: str) -> int:
    import ctranslate2
    import faster_whisper
    from faster_whisper import WhisperModel

    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    req = json.loads(sys.stdin.read())
    model = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=min(_cpus(), 2))
    results = []
    for path in req["files"]:
        segments, info = model.transcribe(path, **req["options"])
        segs = [
            {
                "id": s.id,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "words": None
                if s.words is None
                else [{"word": w.word, "start": w.start, "end": w.end, "probability": w.probability} for w in s.words],
            }
            for s in segments
        ]
        results.append(
            {
                "text": "".join(s["text"] for s in segs).strip(),
                "language": info.language,
                "duration": info.duration,
                "segments": segs,
            }
        )
    proto.write(
        json.dumps(
            {
                "versions": {"faster-whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__},
                "results": results,
            }
        )
        + "\n"
    )
    return 0


def serve(kind: str, model: Path, compute_type: str | None) -> int:
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    load, versions = {
        "fw": lambda: fw_backend(model, compute_type),
        "ov": lambda: ov_backend(model),
        "wcpp": lambda: wcpp_backend(model),
    }[kind]()
    loaded: dict[tuple[int, int], object] = {}

    def model_for(threads: int, workers: int):
        if (threads, workers) not in loaded:
            if kind != "fw":  # one pool at a time: W replicas of every configuration tried would add up
                loaded.clear()
            loaded[threads, workers] = load(threads, workers)
        return loaded[threads, workers]

    def timed(transcribe, path: str, batch: int) -> dict:
        t0 = time.perf_counter()
        try:
            text = transcribe(path, batch)
            return {"latency_s": time.perf_counter() - t0, "text": text, "error": None}
        except Exception as exc:
            return {"latency_s": time.perf_counter() - t0, "text": None, "error": f"{type(exc).__name__}: {exc}"}

    model_for(1, 1)
    proto.write(
        json.dumps(
            {"ready": True, "pid": os.getpid(), "compute_type": compute_type, "cpus": _cpus(), "versions": versions}
        )
        + "\n"
    )
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] != "run":
            proto.write(json.dumps({"error": f"unknown op {req['op']!r}"}) + "\n")
            continue
        conc, batch = int(req["concurrency"]), int(req.get("batch") or 0)
        if batch and kind != "fw":
            proto.write(json.dumps({"error": "batch is faster-whisper's long-file mode only"}) + "\n")
            continue
        transcribe = model_for(int(req["cpu_threads"]), int(req["num_workers"]))
        if req.get("warmup"):
            transcribe(req["files"][0], batch)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=conc) as pool:
            results = list(pool.map(lambda f: timed(transcribe, f, batch), req["files"]))  # noqa: B023
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
        ax.plot(
            [c for c, _ in points],
            [t for _, t in points],
            marker=next(markers, "o"),
            linewidth=2.5 if ours else 1.2,
            label=system["spec"]["label"] + (" (ours)" if ours else ""),
        )
    ax.set_xscale("log", base=2)
    if levels_seen:
        ax.set_xticks(sorted(levels_seen), [str(c) for c in sorted(levels_seen)])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput (audio seconds / wall second)")
    cpu, meta = results.get("cpu", {}), results.get("meta", {})
    n = len(results.get("plan", {}).get("requests", []))
    ax.set_title(
        f"{cpu.get('model', '?')} ({cpu.get('isa', '?')}), {cpu.get('cpus', '?')} CPUs, "
        f"load {meta.get('loadavg_start', '?')}\nthe same {n} requests at every level",
        fontsize=9,
    )
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
    ov = sub.add_parser("ov", help="serve OpenVINO GenAI's WhisperPipeline over stdin/stdout")
    ov.add_argument("--model", type=Path, required=True, help="OpenVINO IR folder (optimum-cli export openvino)")
    wc = sub.add_parser("wcpp", help="serve whisper.cpp (pywhispercpp) over stdin/stdout")
    wc.add_argument("--model", type=Path, required=True, help="ggml model file")
    ref = sub.add_parser("fw-ref", help="faster-whisper once over a list of files, as the tests' reference")
    ref.add_argument("--model", type=Path, required=True, help="CTranslate2 model folder")
    ref.add_argument("--compute-type", required=True, choices=["int8", "float32", "int8_float32", "float16"])
    pl = sub.add_parser("plot", help="throughput vs concurrency PNG")
    pl.add_argument("--json", type=Path, required=True)
    pl.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "plot":
        return plot(args.json, args.out)
    need = {
        "fw": args.model / "model.bin",
        "fw-ref": args.model / "model.bin",
        "ov": args.model / "openvino_encoder_model.xml",
        "wcpp": args.model,
    }
    if not need[args.cmd].is_file():
        print(f"error: {need[args.cmd]} missing", file=sys.stderr)
        return 2
    if args.cmd == "fw-ref":
        return fw_reference(args.model, args.compute_type)
    return serve(args.cmd, args.model, getattr(args, "compute_type", None))


if __name__ == "__main__":
    sys.exit(main())
