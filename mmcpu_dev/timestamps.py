"""Speech clips for the timestamp and subtitle checks, and how many of a transcript's words its timestamped forms
(verbose_json segments, SRT and WebVTT cues) keep (tests/test_timestamps.py, docs/bench/timestamps.md).

Clips are espeak-ng passages of :data:`mmcpu_dev.speech.SENTENCES` repeated, spoken at a given rate: dense speech
with short pauses, the case where segments used to lose words. Deterministic (``sox -R``), cached by name.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import soundfile

from mmcpu_dev import speech

# (name, sentences, words/min): 4 s to 57 s (one and two windows) plus a several-minute file (many windows).
CLIPS = [
    ("s1-110", 1, 110),
    ("s2-160", 2, 160),
    ("s3-130", 3, 130),
    ("s4-175", 4, 175),
    ("s5-130", 5, 130),
    ("s6-160", 6, 160),
    ("s7-160", 7, 160),
    ("s8-160", 8, 160),
    ("s9-130", 9, 130),
    ("s12-160", 12, 160),
    ("s14-160", 14, 160),
    ("s17-175", 17, 175),
]
LONG = ("s80-160", 80, 160)


def passage(sentences: int) -> str:
    return " ".join(itertools.islice(itertools.cycle(speech.SENTENCES), sentences))


def clip(name: str, sentences: int, speed: int, out_dir: Path) -> tuple[Path, float]:
    """The clip's WAV (made once) and its duration in seconds."""
    path = out_dir / f"{name}.wav"
    if not path.is_file():
        speech.synthesize(passage(sentences), path, speed=speed)
    return path, soundfile.info(str(path)).duration


def words(text: str) -> list[str]:
    return speech.normalize(text).split()


def srt_text(body: str) -> str:
    import srt

    return " ".join(cue.content for cue in srt.parse(body))


def vtt_text(body: str) -> str:
    import io

    import webvtt

    return " ".join(cue.text for cue in webvtt.from_buffer(io.StringIO(body)))


def kept(reference: str, other: str) -> int:
    """Words of ``reference`` that ``other`` keeps: the hits of jiwer's word alignment."""
    import jiwer

    a, b = " ".join(words(reference)), " ".join(words(other))
    if not a or not b:
        return 0
    return jiwer.process_words(a, b).hits


def transcribe(base_url: str, model: str, path: Path, response_format: str, **fields: object) -> str | dict:
    """One transcription over HTTP (greedy unless ``fields`` say otherwise): the JSON body, or the text of srt/vtt."""
    import httpx

    data = {"model": model, "response_format": response_format, "temperature": "0", **fields}
    data = {k: str(v) for k, v in data.items() if v is not None}
    with path.open("rb") as f:
        r = httpx.post(
            f"{base_url}/v1/audio/transcriptions", data=data, files={"file": (path.name, f, "audio/wav")}, timeout=900
        )
    r.raise_for_status()
    return r.text if response_format in ("srt", "vtt", "text") else r.json()


def measure(base_url: str, model: str, clips: list[tuple[str, Path, float]], **fields: object) -> list[dict]:
    """Per clip: its words in json, how many of them verbose_json (segments), srt and vtt keep, and the json and
    verbose_json requests' wall times (one request at a time)."""
    import time

    rows = []
    for name, path, seconds in clips:
        t0 = time.perf_counter()
        plain = transcribe(base_url, model, path, "json", **fields)["text"]
        t1 = time.perf_counter()
        verbose = transcribe(base_url, model, path, "verbose_json", **fields)
        t2 = time.perf_counter()
        segments = " ".join(s["text"] for s in verbose.get("segments") or [])
        rows.append(
            {
                "clip": name,
                "seconds": round(seconds, 1),
                "json_words": len(words(plain)),
                "verbose_json": kept(plain, segments),
                "segments": len(verbose.get("segments") or []),
                "srt": kept(plain, srt_text(transcribe(base_url, model, path, "srt", **fields))),
                "vtt": kept(plain, vtt_text(transcribe(base_url, model, path, "vtt", **fields))),
                "json_s": round(t1 - t0, 2),
                "verbose_json_s": round(t2 - t1, 2),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="words kept by verbose_json / srt / vtt against json, per clip")
    parser.add_argument("--url", required=True, help="engine or gateway base URL (no /v1)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--language", default=None)
    parser.add_argument("--clips", type=Path, default=Path(tempfile.gettempdir()) / "mmcpu-timestamp-clips")
    parser.add_argument("--long", action="store_true", help="also the several-minute clip")
    args = parser.parse_args(argv)
    args.clips.mkdir(parents=True, exist_ok=True)
    chosen = [*CLIPS, LONG] if args.long else CLIPS
    clips = [(name, *clip(name, n, speed, args.clips)) for name, n, speed in chosen]
    rows = measure(args.url, args.model, clips, language=args.language)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
