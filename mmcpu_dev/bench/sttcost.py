"""What timestamps cost in the speech package (mmcpu.stt), and how well they fit: both MMCPU_STT_TIMESTAMPS methods
against json on the same clip, on a real engine each (MRV2, tiny.en, MMCPU_STT_ROUTES=plugin).

    python -m mmcpu_dev.bench.sttcost [--pause 3.0] [--reps 3] [--rounds 2] [--methods align,decode]

The clip is the ten plain sentences of mmcpu_dev.speech spoken one after another with known silences between them
(espeak-ng, sox -R: deterministic), 60-120 s long (three of vLLM's 30 s windows), so every sentence's true start is
known. Per method it measures, against json on the same engine:

- c=1: the median wall time of ``--reps`` sequential requests per format (json, verbose_json, verbose_json with
  ``timestamp_granularities=[word, segment]``), the formats interleaved;
- c=8: 8 concurrent requests of one format, ``--rounds`` times; throughput in requests per second;
- words kept: verbose_json's words (normalised) equal json's;
- segment starts: per spoken sentence, the distance from its true start to the nearest segment start (mean and max),
  beside faster-whisper's on the same weights and clip (when the bench venv is there).

It prints a Markdown table (docs/api.md#the-speech-package records one) and, with ``--out``, the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from mmcpu.config import get_settings
from mmcpu_dev import speech
from mmcpu_dev.servers import Engine

RATE = 16_000
FORMATS: dict[str, dict[str, Any]] = {
    "json": {"response_format": "json"},
    "verbose_json": {"response_format": "verbose_json"},
    "words": {"response_format": "verbose_json", "timestamp_granularities[]": ["word", "segment"]},
}
CONCURRENCY = 8


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def clip(out: Path, pause_s: float) -> tuple[Path, list[str], list[float]]:
    sentences = speech.SENTENCES + speech.MORE_SENTENCES
    path, spans = speech.conversation(out, sentences, pause_s=pause_s)
    return path, sentences, [a / RATE for a, _ in spans]


def post(engine: Engine, audio: bytes, fields: dict[str, Any]) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    response = httpx.post(
        f"{engine.base_url}/v1/audio/transcriptions",
        data={"model": engine.name, "temperature": "0", **fields},
        files={"file": ("clip.wav", audio, "audio/wav")},
        timeout=600,
    )
    elapsed = time.perf_counter() - t0
    response.raise_for_status()
    return response, elapsed


def start_errors(segment_starts: list[float], truth: list[float]) -> tuple[float, float]:
    """Mean and max over the spoken sentences of the distance from a sentence's true start to the nearest start."""
    if not segment_starts:
        return float("inf"), float("inf")
    errors = [min(abs(s - t) for s in segment_starts) for t in truth]
    return statistics.fmean(errors), max(errors)


def served_formats(engine: Engine, audio: bytes) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Warm every path once. Word timestamps may be refused (``MMCPU_STT_TIMESTAMPS=decode`` answers them with a 400):
    then they are left out of the measurement, and the engine's error message is kept for the table."""
    formats, refused = dict(FORMATS), None
    for name, fields in FORMATS.items():
        try:
            post(engine, audio, fields)
        except httpx.HTTPStatusError as e:
            if name != "words" or e.response.status_code != 400:
                raise
            refused = e.response.json()["error"]["message"]
            del formats[name]
    return formats, refused


def measure(engine: Engine, audio: bytes, truth: list[float], reps: int, rounds: int) -> dict[str, Any]:
    formats, words_refused = served_formats(engine, audio)
    c1: dict[str, list[float]] = {name: [] for name in formats}
    for _ in range(reps):
        for name, fields in formats.items():
            c1[name].append(post(engine, audio, fields)[1])
    c8: dict[str, float] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for name, fields in formats.items():
            t0 = time.perf_counter()
            for _ in range(rounds):
                list(pool.map(post, [engine] * CONCURRENCY, [audio] * CONCURRENCY, [fields] * CONCURRENCY))
            c8[name] = CONCURRENCY * rounds / (time.perf_counter() - t0)
    json_text = post(engine, audio, FORMATS["json"])[0].json()["text"]
    verbose, _ = post(engine, audio, FORMATS["verbose_json"])
    doc = verbose.json()
    words = post(engine, audio, FORMATS["words"])[0] if words_refused is None else None
    starts = [s["start"] for s in doc["segments"]]
    mean, worst = start_errors(starts, truth)
    return {
        "route": verbose.headers.get("mmcpu-stt-route"),
        "words_route": words.headers.get("mmcpu-stt-route") if words is not None else None,
        "words_refused": words_refused,
        "c1_s": {name: statistics.median(v) for name, v in c1.items()},
        "c8_rps": c8,
        "words_kept": speech.normalize(doc["text"]).split() == speech.normalize(json_text).split(),
        "segment_text_kept": speech.normalize(" ".join(s["text"] for s in doc["segments"])).split()
        == speech.normalize(json_text).split(),
        "segments": len(starts),
        "start_error_mean_s": mean,
        "start_error_max_s": worst,
    }


def faster_whisper_errors(path: Path, truth: list[float]) -> tuple[float, float] | None:
    from mmcpu_dev import reference

    if not reference.available():
        return None
    (result,) = reference.transcribe([path], reference.weights("whisper-tiny.en"))
    return start_errors([s["start"] for s in result["segments"]], truth)


def table(results: dict[str, dict[str, Any]], fw: tuple[float, float] | None, duration: float) -> str:
    lines = [
        "| method | format | c=1 wall time (x json) | c=8 throughput (x json) | json's words kept | segment start "
        "error mean / max |",
        "|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        for name in ("json", "verbose_json", "words"):
            label = {"json": "json", "verbose_json": "verbose_json (segments)", "words": "verbose_json + words"}[name]
            if name not in r["c1_s"]:
                lines.append(f"| {method} | {label} | 400: {r['words_refused']} | | | |")
                continue
            c1, c8 = r["c1_s"][name], r["c8_rps"][name]
            if name == "words" and r["words_route"] != "plugin":
                label += f" ({r['words_route']})"
            kept = "-" if name == "json" else ("yes" if r["words_kept"] else "no")
            err = (
                f"{r['start_error_mean_s']:.2f} / {r['start_error_max_s']:.2f} s ({r['segments']} segments)"
                if name == "verbose_json"
                else ""
            )
            lines.append(
                f"| {method} | {label} | {c1:.2f} s ({c1 / r['c1_s']['json']:.2f}x) | "
                f"{c8:.2f} req/s ({c8 / r['c8_rps']['json']:.2f}x) | {kept} | {err} |"
            )
    if fw is not None:
        lines.append(f"| faster-whisper 1.2.1 (same weights, greedy) | segments | | | | {fw[0]:.2f} / {fw[1]:.2f} s |")
    return "\n".join(lines) + f"\n\nclip: {duration:.1f} s, 10 sentences; CPU: {cpu_name()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pause", type=float, default=3.0, help="silence between sentences, seconds")
    parser.add_argument("--reps", type=int, default=3, help="sequential requests per format (c=1)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of 8 concurrent requests per format (c=8)")
    parser.add_argument("--methods", default="align,decode", help="MMCPU_STT_TIMESTAMPS values to compare")
    parser.add_argument("--model", type=Path, default=get_settings().models_dir / "whisper-tiny.en")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    logs = get_settings().cache_dir / "logs"
    with tempfile.TemporaryDirectory() as tmp:
        path, _, truth = clip(Path(tmp) / "sentences.wav", args.pause)
        audio = path.read_bytes()
        duration = (len(audio) - 44) / 2 / RATE
        results: dict[str, dict[str, Any]] = {}
        for method in args.methods.split(","):
            env = {"MMCPU_STT_ROUTES": "plugin", "MMCPU_STT_TIMESTAMPS": method}
            with Engine(model=args.model, log_path=logs / f"sttcost-{method}.log", env=env) as engine:
                results[method] = measure(engine, audio, truth, args.reps, args.rounds)
            print(method, json.dumps(results[method]), flush=True)
        fw = faster_whisper_errors(path, truth)
    print(table(results, fw, duration))
    if args.out:
        args.out.write_text(json.dumps({"results": results, "faster_whisper": fw, "cpu": cpu_name()}, indent=1))


if __name__ == "__main__":
    main()
