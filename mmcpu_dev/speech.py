"""Real speech for tests, smoke checks and benchmarks: espeak-ng speaks, sox resamples, jiwer scores."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import unicodedata
from pathlib import Path

# Plain sentences espeak-ng pronounces clearly; at 130 words/min tiny.en transcribes them at WER ~0.21
# (0.43 at espeak's default 175: measured, the same tokens with CTranslate2).
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "She sells sea shells by the sea shore.",
    "We will meet at the train station at nine in the morning.",
]

# More plain sentences, for WER comparisons that must tell a real loss from one word flipped (two models on five
# short clips differ by a few words by chance alone). Kept out of SENTENCES, which the benchmark workload and the
# timestamp clips are built from, so their figures stay comparable.
MORE_SENTENCES = [
    "The children played in the park until the sun went down.",
    "Could you open the window and let some fresh air into the room?",
    "My grandmother grows tomatoes and beans in her small garden.",
    "The last bus leaves the old town late in the evening.",
    "He wrote a long letter to his friend who lives in Canada.",
]

# One passage per language for multilingual Whisper (tests/test_multilingual.py), spoken by espeak-ng's voice of
# that language with its "m3" variant (``de+m3``) at PASSAGE_SPEED. Chosen by measurement on whisper-base (real
# weights), because espeak-ng's non-English voices are poor: single short sentences, or the plain voices at other
# rates, were often detected as another language (French and Spanish as Thai, Japanese or English). For
# these passages the detection probability of the right language (transformers, same weights, among vLLM's 57
# languages) was 0.94-0.98 for every rate from 110 to 130 words/min (German: 0.98 from 120 to 150).
PASSAGE_SPEED = 120
PASSAGE_VOICE = "{lang}+m3"
PASSAGES = {
    "de": "Guten Morgen, ich heiße Anna und wohne in Berlin. "
    "Jeden Morgen trinke ich einen Kaffee und lese die Zeitung.",
    "fr": "Bonjour tout le monde. Je suis très content de vous voir aujourd'hui. Nous allons parler de la France.",
    "es": "Buenos días a todos. Estoy muy contento de verlos hoy. Vamos a hablar de España.",
}


def synthesize(text: str, out: Path, *, speed: int = 130, voice: str | None = None) -> Path:
    """Speak ``text`` into ``out`` as 16 kHz mono 16-bit WAV (what Whisper expects); ``voice``: an espeak-ng
    voice (``espeak-ng --voices``, e.g. ``de``), None = espeak-ng's default (English)."""
    for tool in ("espeak-ng", "sox"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (apt-get install espeak-ng sox)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        voice_args = ["-v", voice] if voice else []
        subprocess.run(
            ["espeak-ng", *voice_args, "-s", str(speed), "-w", str(raw), text], check=True, capture_output=True
        )
        # -R: no dither when sox lowers the bit depth after resampling, so the same text is the same samples
        subprocess.run(
            ["sox", "-R", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out)], check=True, capture_output=True
        )
    return out


def normalize(text: str) -> str:
    """Lower case, no punctuation, single spaces: WER should judge words, not formatting. Letters of any script
    are kept (``heiße``, ``très``); for ASCII text that is the same as keeping ``[a-z0-9']``."""
    text = re.sub(r"[^\w' ]+|_", " ", unicodedata.normalize("NFC", text).lower())
    return " ".join(text.split())


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Overall WER (all clips pooled) after :func:`normalize`."""
    import jiwer  # only scoring needs it

    return jiwer.wer([normalize(r) for r in references], [normalize(h) or "<empty>" for h in hypotheses])


def conversation(
    out: Path, sentences: list[str], *, pause_s: float = 1.2, lead_s: float = 0.5, speed: int = 130
) -> tuple[Path, list[tuple[int, int]]]:
    """One 16 kHz WAV of ``sentences`` spoken one after another with ``pause_s`` of silence between them (and
    ``lead_s`` before the first and after the last): a speaker taking turns. Returns the file and each sentence's
    (start, end) in samples, where espeak-ng's own leading and trailing silence is trimmed off."""
    import numpy as np
    import soundfile

    rate = 16_000
    parts, spans, pos = [np.zeros(int(lead_s * rate), dtype=np.int16)], [], int(lead_s * rate)
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(sentences):
            samples, _ = soundfile.read(synthesize(text, Path(tmp) / f"{i}.wav", speed=speed), dtype="int16")
            loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > 64)
            samples = samples[loud[0] : loud[-1] + 1] if loud.size else samples
            spans.append((pos, pos + samples.size))
            gap = np.zeros(int((pause_s if i < len(sentences) - 1 else lead_s) * rate), dtype=np.int16)
            parts += [samples, gap]
            pos += samples.size + gap.size
    soundfile.write(out, np.concatenate(parts), rate, subtype="PCM_16")
    return out, spans
