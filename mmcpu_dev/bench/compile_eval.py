"""python -m mmcpu_dev.bench.compile_eval: eager against vLLM's own compilation (inductor) for the audio default.

The audio role's default engine (``plan.role_engine``: checkpoint, dtype, quantisation, MRV2) is started three
times with ``MMCPU_COMPILE=1`` and once eager:

1. compiled, cold: an empty ``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` (start-up = the build);
2. compiled, warm, without a compiler: the same cache directories, ``$CXX`` pointed at a stand-in that records every
   call and fails, the way a runtime image without g++ would behave (the build-time-artifact scheme);
3. eager (``--enforce-eager``, the default), beside the warm compiled engine.

Both running engines then take the same transcriptions at c=1, interleaved request by request (the order swapped
every round), so load from other processes on a shared machine falls on both alike. Per engine, from vLLM's own
Prometheus histograms (deltas over the measured requests): inter-token latency (one decode step, host work
included), decode time and generated tokens. With ``--pyspy``, py-spy samples each EngineCore during its requests;
the share of its busy samples inside the model's forward (native ops and, eager, the module's Python) against the
rest of the step (MRV2 input preparation, sampling, output handling) splits the step. Optionally c=4 throughput,
interleaved the same way. The JSON goes to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from mmcpu.config import REPO_ROOT, get_settings
from mmcpu_dev.bench.c1profile import METRICS, mean_of, pids_of, scrape

# Frames that mark the model's forward in the EngineCore (eager: the module; compiled: vLLM's wrapper around it).
FORWARD_MARKS = ("model_executor/models/whisper.py", "compilation/")
ENCODER = re.compile(r"mm_encoder|embed_multimodal|get_multimodal_embeddings|WhisperEncoder|encoder_runner")
FAKE_CXX = """#!/bin/sh
echo "$0 $*" >> "{log}"
exit 1
"""
# The names inductor (and anything it runs) could reach for a C++ compiler through PATH.
COMPILER_NAMES = ("g++", "c++", "gcc", "cc", "clang++", "clang")


def fake_compiler(where: Path) -> tuple[Path, Path]:
    """A folder to put first on PATH whose compilers all fail and log each call: inductor still finds "g++" by
    name (its config, and so vLLM's cache key, is unchanged), the launcher's preflight lets the engine start, and a
    warm start that needs no compiler never calls it. (Pointing $CXX elsewhere instead changes inductor's config
    and so the cache key: a guaranteed miss.)"""
    log = where / "cxx-calls.log"
    bin_dir = where / "no-compiler"
    bin_dir.mkdir(exist_ok=True)
    for name in COMPILER_NAMES:
        script = bin_dir / name
        script.write_text(FAKE_CXX.format(log=log))
        script.chmod(0o755)
    return bin_dir, log


def engine(tag: str, out: Path, env: dict[str, str]):
    from mmcpu_dev.bench import plan as plans
    from mmcpu_dev.servers import Engine

    model, args, _ = plans.role_engine("audio", get_settings())
    return Engine(model, out / f"compile-{tag}.log", vllm_args=list(args), env=env)


def started(eng, timeout_s: float = 900) -> float:
    t0 = time.monotonic()
    eng.start(timeout_s=timeout_s)
    return time.monotonic() - t0


def stack_share(raw: str) -> dict[str, float]:
    """py-spy raw (collapsed) stacks of an EngineCore -> shares of its busy samples: the encoder pass, the model's
    forward in decode (native ops and, eager, the module's Python around them), and the rest (MRV2's input
    preparation, sampling, scheduling, output handling); ``samples`` = their total."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or not stack:
            continue
        frames = stack.split(";")
        if any(ENCODER.search(f) for f in frames):
            key = "encoder"
        elif any(m in f for f in frames for m in FORWARD_MARKS):
            key = "forward"
        else:
            key = "host"
        counts[key] += int(n)
    total = sum(counts.values())
    return {k: round(counts[k] / total, 3) if total else 0.0 for k in ("encoder", "forward", "host")} | {
        "samples": float(total)
    }


def measure(engines: dict, clips: list, rounds: int, out: Path, pyspy: Path | None) -> dict:
    from mmcpu_dev.bench.runners import Http, Profiler

    https = {k: Http(e.base_url, audio_model=e.name) for k, e in engines.items()}
    for h in https.values():
        for clip in clips:
            h.transcribe(clip)  # warm-up (and, compiled, any shape not yet seen)
    before = {k: scrape(e.base_url) for k, e in engines.items()}
    walls: dict[str, list[float]] = {k: [] for k in engines}
    texts: dict[str, list[str]] = {k: [] for k in engines}
    cores = {k: pids_of(e)[1] for k, e in engines.items()}
    profs = {}
    if pyspy:
        profs = {k: Profiler(pyspy, pid, out / f"compile-{k}.pyspy.txt", rate=250) for k, pid in cores.items()}
        for p in profs.values():
            p.__enter__()
    load0 = os.getloadavg()[0]
    try:
        order = list(engines)
        for r in range(rounds):
            for clip in clips:
                for k in order if r % 2 == 0 else order[::-1]:
                    s = time.perf_counter()
                    texts[k].append(https[k].transcribe(clip))
                    walls[k].append(time.perf_counter() - s)
    finally:
        for p in profs.values():
            p.__exit__(None, None, None)
    after = {k: scrape(e.base_url) for k, e in engines.items()}
    res: dict = {"load": [load0, os.getloadavg()[0]]}
    for k in engines:
        r = {name: mean_of(before[k], after[k], name) for name in METRICS}
        r["wall_ms_p50"] = 1e3 * statistics.median(walls[k])
        r["texts"] = texts[k]
        if pyspy:
            raw = out / f"compile-{k}.pyspy.txt"
            r["pyspy"] = stack_share(raw.read_text(errors="replace")) if raw.is_file() else {}
        res[k] = r
    return res


def throughput(engines: dict, clips: list, concurrency: int) -> dict:
    from mmcpu_dev.bench.runners import Http

    res: dict = {}
    for k in list(engines) + list(engines)[::-1]:
        rnd = Http(engines[k].base_url, audio_model=engines[k].name).audio_round(clips, concurrency)
        res.setdefault(k, []).append(sum(c.seconds for c in clips) / rnd.wall_s)
    return {k: round(statistics.mean(v), 3) for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    from mmcpu import cpu
    from mmcpu_dev.bench import inputs
    from mmcpu_dev.bench import plan as plans

    ap = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench.compile_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=4, help="clips of the fixed workload (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the clips after one warm-up")
    ap.add_argument("--c4", action="store_true", help="also c=4 throughput (audio-s/s), interleaved")
    ap.add_argument("--pyspy", action="store_true", help="py-spy on each EngineCore during the c=1 requests")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "compile-eval")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--vllm-aot", choices=("0", "1"), default="0", help="VLLM_USE_AOT_COMPILE for the compiled engine")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = get_settings()
    clips = inputs.clips(plans.workload()[: args.clips], settings.cache_dir / "bench" / "clips")
    res: dict = {"cpu": cpu.current().line(), "clips": [c.seconds for c in clips], "vllm_aot": args.vllm_aot}
    print("CPU:", res["cpu"], flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="compile-eval-", dir=args.out))
    caches = {"VLLM_CACHE_ROOT": str(tmp / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    # VLLM_USE_AOT_COMPILE=1 (vLLM's default on torch >= 2.12) saves an artifact that vLLM 0.32 cannot load back on
    # torch 2.13 ("'function' object has no attribute 'finalize_loading'") and so compiles again at every start.
    compiled_env = {"MMCPU_COMPILE": "1", "VLLM_USE_AOT_COMPILE": args.vllm_aot, **caches}
    cold = engine("compiled-cold", args.out, compiled_env)
    try:
        res["start_compiled_cold_s"] = round(started(cold), 1)
    finally:
        cold.stop()
    print("compiled cold start", res["start_compiled_cold_s"], flush=True)
    no_cxx, cxx_log = fake_compiler(tmp)
    hidden = {**compiled_env, "PATH": os.pathsep.join([str(no_cxx), os.environ.get("PATH", "")])}
    warm = engine("compiled-warm", args.out, hidden)
    eager = engine("eager", args.out, {})
    try:
        try:
            res["start_compiled_warm_no_cxx_s"] = round(started(warm), 1)
        except Exception as exc:  # a warm start that still needs the compiler: say so, then measure with g++
            res["warm_no_cxx_error"] = f"{type(exc).__name__}: {exc}"[:500]
            res["warm_no_cxx_log_tail"] = warm.log()[-3000:]
            warm.stop()
            warm = engine("compiled-warm-cxx", args.out, compiled_env)
            res["start_compiled_warm_s"] = round(started(warm), 1)
        res["start_eager_s"] = round(started(eager), 1)
        print(
            "warm",
            res.get("start_compiled_warm_no_cxx_s"),
            res.get("warm_no_cxx_error"),
            res.get("start_compiled_warm_s"),
            "eager",
            res["start_eager_s"],
            flush=True,
        )
        pyspy = REPO_ROOT / ".cache" / "bench-venv" / "bin" / "py-spy" if args.pyspy else None
        engines = {"eager": eager, "compiled": warm}
        res["c1"] = measure(engines, clips, args.rounds, args.out, pyspy)
        if args.c4:
            res["c4_audio_s_per_s"] = throughput(engines, clips, 4)
        res["cxx_calls"] = cxx_log.read_text().splitlines() if cxx_log.is_file() else []
    finally:
        warm.stop()
        eager.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for k in ("eager", "compiled"):
        r = res["c1"][k]
        print(
            f"{k}: ITL {1e3 * r['inter_token_latency_seconds']:.2f} ms,"
            f" decode {1e3 * r['request_decode_time_seconds']:.0f}"
            f" ms over {r['request_generation_tokens']:.0f} tokens, wall p50 {r['wall_ms_p50']:.0f} ms,"
            f" pyspy {r.get('pyspy')}",
            flush=True,
        )
    same = res["c1"]["eager"]["texts"] == res["c1"]["compiled"]["texts"]
    res["same_texts"] = same
    print("same texts:", same, "c4:", res.get("c4_audio_s_per_s"), "cxx calls:", len(res["cxx_calls"]), flush=True)
    (args.json or args.out / "compile-eval.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
