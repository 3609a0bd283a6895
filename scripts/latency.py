#!/usr/bin/env python3
"""Per-request latency under MRV2 vs the V1 runner, plus ready time and RSS per model (prints figures).

    python scripts/latency.py [--requests N] [--models whisper,llava] [--json OUT]

Starts one real vLLM server at a time (patched venv), sends one warm-up request, then N timed requests
(one espeak-ng clip for Whisper; a two-image chat for LLaVA). Nothing is asserted: figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmcpu.dev import speech
from mmcpu.config import VISION_LIMIT_ARGS, get_settings
from mmcpu.dev.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu.dev.servers import Engine


def measure(engine: Engine, send, n: int) -> list[float]:
    send()  # warm-up: first request compiles/loads lazily
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        send()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--models", default="whisper,llava")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    settings = get_settings()
    logs = settings.cache_dir / "logs"
    clip = speech.synthesize(speech.SENTENCES[0], Path(tempfile.mkdtemp()) / "clip.wav")
    models = {
        "whisper": (settings.models_dir / "whisper-tiny.en", []),
        "llava": (settings.models_dir / "tiny-llava", VISION_LIMIT_ARGS),
    }
    rows = []
    for key in args.models.split(","):
        model, vllm_args = models[key]
        if not model.is_dir():
            print(f"error: {model} missing (run `make models`)", file=sys.stderr)
            return 2
        for runner in ("v2", "v1"):
            log = logs / f"latency-{model.name}-{runner}.log"
            with Engine(model=model, log_path=log, runner=runner, vllm_args=vllm_args) as engine:
                client = engine.client()
                if key == "whisper":
                    send = lambda: client.audio.transcriptions.create(  # noqa: E731
                        **transcription_kwargs(clip, model=engine.name, language="en"))
                else:
                    send = lambda: client.chat.completions.create(  # noqa: E731
                        **image_chat_kwargs([test_image(1), test_image(2)], model=engine.name))
                times = measure(engine, send, args.requests)
                row = {
                    "model": model.name, "runner": runner, "ready_s": round(engine.ready_s, 1),
                    "rss_gib": round(engine.rss_bytes() / 2**30, 2),
                    "p50_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
                    "max_s": round(max(times), 3), "requests": len(times),
                }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'model':<18}{'runner':<8}{'ready s':>9}{'RSS GiB':>9}{'p50 s':>9}{'min s':>9}{'max s':>9}")
    for r in rows:
        print(f"{r['model']:<18}{r['runner']:<8}{r['ready_s']:>9}{r['rss_gib']:>9}{r['p50_s']:>9}{r['min_s']:>9}{r['max_s']:>9}")
    for key in {r["model"] for r in rows}:
        v2 = next((r for r in rows if r["model"] == key and r["runner"] == "v2"), None)
        v1 = next((r for r in rows if r["model"] == key and r["runner"] == "v1"), None)
        if v1 and v2:
            print(f"{key}: MRV2 / V1 p50 latency = {v2['p50_s'] / v1['p50_s']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
