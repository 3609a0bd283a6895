"""Voice-activity chunking measured: ``python -m mmcpu_dev.bench.vad [--out docs/bench/vad.json]``.

The clips (also tests/test_vad.py's): :func:`pauses_clip`, ~2 minutes of espeak-ng speech with long pauses (about
half silence), where the spoken spans are known; :func:`noise_clip`, 30 s of sox pink noise; :func:`silence_clip`,
30 s of digital silence. All deterministic (sox -R).

It starts one whisper-tiny.en engine (MRV2) and measures, per clip: wall time with and without
``chunking_strategy="auto"`` (best of ``--rounds``), the text, its WER, how many windows were encoded (the
engine's finished-request counter), and faster-whisper (vad_filter off / on, same weights, float32, greedy) on the
same clips; plus the VAD's own cost per audio-minute in this process (mmcpu.vad.plan, one thread).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
import wave
from pathlib import Path

import numpy as np

from mmcpu_dev import speech

RATE = 16_000
# (sentence index into speech.SENTENCES, seconds of silence after it): 8 utterances of two sentences each, with
# pauses of 2.5-12 s, so about half of the ~2 minutes is silence.
PAUSES_LEAD_S = 4.0
PAUSES = [(0, 7.0), (1, 3.0), (2, 11.0), (3, 5.0), (4, 9.0), (0, 2.5), (2, 12.0), (1, 4.0)]


def _read(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def _write(path: Path, samples: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(np.asarray(samples, dtype="<i2").tobytes())
    return path


def pauses_clip(out_dir: Path) -> tuple[Path, str, list[tuple[float, float]]]:
    """The long clip with pauses: its path, its reference text and the (start, end) seconds of each utterance."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [np.zeros(int(PAUSES_LEAD_S * RATE), dtype=np.int16)]
    texts, spans = [], []
    pos = len(parts[0])
    for n, (index, pause_s) in enumerate(PAUSES):
        text = f"{speech.SENTENCES[index]} {speech.SENTENCES[(index + 1) % len(speech.SENTENCES)]}"
        voiced = _read(speech.synthesize(text, out_dir / f"utterance{n}.wav"))
        # espeak-ng's own leading/trailing silence is part of the utterance; the span is its voiced part.
        loud = np.flatnonzero(np.abs(voiced.astype(np.int32)) > 300)
        spans.append(((pos + loud[0]) / RATE, (pos + loud[-1] + 1) / RATE))
        parts += [voiced, np.zeros(int(pause_s * RATE), dtype=np.int16)]
        pos += len(voiced) + int(pause_s * RATE)
        texts.append(text)
    return _write(out_dir / "pauses.wav", np.concatenate(parts)), " ".join(texts), spans


def noise_clip(out_dir: Path, seconds: float = 30) -> Path:
    """Pink noise at about -25 dBFS, no speech (sox -R: the same samples every run)."""
    out = out_dir / "noise.wav"
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "sox",
            "-R",
            "-n",
            "-r",
            str(RATE),
            "-c",
            "1",
            "-b",
            "16",
            str(out),
            "synth",
            str(seconds),
            "pinknoise",
            "vol",
            "0.1",
        ],
        check=True,
        capture_output=True,
    )
    return out


def silence_clip(out_dir: Path, seconds: float = 30) -> Path:
    return _write(out_dir / "silence.wav", np.zeros(int(seconds * RATE), dtype=np.int16))


def audio(path: Path) -> np.ndarray:
    return _read(path).astype(np.float32) / 32768


def finished_requests(base_url: str) -> float:
    """The engine's count of finished engine requests (every encoded window is one)."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def vad_cost(samples: np.ndarray, rounds: int = 5) -> dict:
    """Seconds of CPU per audio-minute for mmcpu.vad.plan (the session created beforehand, best of ``rounds``)."""
    from mmcpu import vad

    vad.session()
    best = min(_timed(lambda: vad.plan(samples, RATE, vad.AUTO, 30)) for _ in range(rounds))
    minutes = samples.size / RATE / 60
    return {"audio_s": samples.size / RATE, "best_s": best, "s_per_audio_min": best / minutes}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(out_dir: Path, rounds: int) -> dict:
    from mmcpu.config import get_settings
    from mmcpu_dev import reference
    from mmcpu_dev.servers import test_engine

    settings = get_settings()
    clip, text, spans = pauses_clip(out_dir)
    clips = {"pauses": (clip, text), "noise": (noise_clip(out_dir), ""), "silence": (silence_clip(out_dir), "")}
    result: dict = {"speech_spans_s": spans, "vad_cost": vad_cost(audio(clip))}
    model = settings.models_dir / "whisper-tiny.en"
    with test_engine(model, settings.cache_dir / "logs", "vad-bench") as engine:
        client = engine.client()
        for name, (path, reference_text) in clips.items():
            for strategy in (None, "auto"):
                extra = {} if strategy is None else {"chunking_strategy": strategy}
                times, windows, answer = [], 0.0, ""
                for _ in range(rounds):
                    before = finished_requests(engine.base_url)
                    t0 = time.perf_counter()
                    answer = client.audio.transcriptions.create(
                        model=engine.name, file=path.open("rb"), language="en", temperature=0, **extra
                    ).text
                    times.append(time.perf_counter() - t0)
                    windows = finished_requests(engine.base_url) - before
                row = {"best_s": min(times), "windows": windows, "text": answer, "audio_s": audio(path).size / RATE}
                if reference_text:
                    row["wer"] = speech.word_error_rate([reference_text], [answer])
                result[f"{name}/{strategy or 'none'}"] = row
    if reference.available():
        weights = reference.weights("whisper-tiny.en")
        for vad_filter in (False, True):
            t0 = time.perf_counter()
            refs = reference.transcribe([p for p, _ in clips.values()], weights, language="en", vad_filter=vad_filter)
            wall = time.perf_counter() - t0
            for (name, (_, reference_text)), ref in zip(clips.items(), refs, strict=False):
                row = {"text": ref["text"], "wall_s_all_clips_incl_load": wall}
                if reference_text:
                    row["wer"] = speech.word_error_rate([reference_text], [ref["text"]])
                result[f"{name}/faster-whisper{'-vad' if vad_filter else ''}"] = row
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench.vad", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--clips", type=Path, default=Path("/tmp/mmcpu-vad-clips"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.clips, args.rounds)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
