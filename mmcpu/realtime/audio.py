"""Audio of a realtime session: base64 PCM16 in, 16 kHz int16 samples out, WAV for the engine.

OpenAI's wire sends 24 kHz little-endian PCM16 (``audio/pcm``, beta ``pcm16``); 16 kHz is accepted too (no
resampling then). 24 kHz is resampled with soxr's streaming resampler: its output over the appended chunks is the
output for the whole stream, so where the client cuts its chunks changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave

import numpy as np
import soxr

ENGINE_RATE = 16_000  # Whisper's and Silero's rate
RATES = (24_000, 16_000)  # OpenAI's one rate first; 16 kHz as many clients capture it


class AudioError(ValueError):
    """An append whose audio cannot be read (answered with an ``error`` event naming ``audio``)."""


def decode_pcm16(data: object) -> np.ndarray:
    """``input_audio_buffer.append``'s ``audio``: base64 of little-endian 16-bit samples, to int16."""
    if not isinstance(data, str):
        raise AudioError(f"'audio' must be a base64 string, not {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioError(f"'audio' is not valid base64: {exc}") from None
    if len(raw) % 2:
        raise AudioError(f"'audio' holds {len(raw)} bytes: 16-bit PCM needs an even number")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16, copy=False)


class Resampler:
    """int16 at ``rate`` -> int16 at 16 kHz, chunk by chunk (soxr HQ). The stream runs in float32 and is rounded
    back to 16 bits here: soxr's own int16 output dithers, so its samples would depend on how the audio was cut
    into chunks (measured: up to 2 LSB on ~40 % of the samples), while float32 gives the same samples for any
    chunking, equal to a one-shot resample of the whole stream."""

    def __init__(self, rate: int) -> None:
        if rate not in RATES:
            raise AudioError(f"sample rate {rate} is not supported: {' or '.join(map(str, RATES))}")
        self.rate = rate
        self._stream = None
        self.flush()

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._int16(self._stream.resample_chunk(samples.astype(np.float32) / 32768.0))

    def flush(self) -> np.ndarray:
        """The samples the filter still holds (~30 ms), at a commit: the turn gets all the audio sent before it.
        The stream then starts again."""
        if self.rate == ENGINE_RATE:
            return np.zeros(0, dtype=np.int16)
        if self._stream is None:
            out = np.zeros(0, dtype=np.int16)
        else:
            out = self._int16(self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        self._stream = soxr.ResampleStream(self.rate, ENGINE_RATE, 1, dtype="float32", quality="HQ")
        return out

    @staticmethod
    def _int16(x: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


def wav_bytes(samples: np.ndarray, rate: int = ENGINE_RATE) -> bytes:
    """Mono 16-bit WAV: the file a client would upload to /v1/audio/transcriptions."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(samples, dtype="<i2").tobytes())
    return out.getvalue()
