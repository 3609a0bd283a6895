"""The one way to build requests: used by the tests, the compose smoke check and the benchmarks.

Each builder returns keyword arguments for the unmodified ``openai`` client, e.g.
``client.audio.transcriptions.create(**transcription_kwargs(...))``.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import struct
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
from PIL import Image

DEFAULT_PROMPT = "Describe the two images."


def transcription_kwargs(
    audio: Path | bytes,
    *,
    model: str,
    language: str | None = None,
    response_format: str = "json",
    filename: str = "speech.wav",
    temperature: float | None = 0.0,
    content_type: str = "audio/wav",
    prompt: str | None = None,
    stream: bool | None = None,
) -> dict[str, Any]:
    """Arguments for ``client.audio.transcriptions.create``; ``None`` (language, temperature, prompt, stream) leaves
    a field out (no temperature: OpenAI's default)."""
    data = audio.read_bytes() if isinstance(audio, Path) else audio
    if isinstance(audio, Path):
        filename = audio.name
    kwargs: dict[str, Any] = {
        "model": model,
        "file": (filename, data, content_type),
        "response_format": response_format,
    }
    if temperature is not None:
        kwargs["temperature"] = temperature
    if language is not None:
        kwargs["language"] = language
    if prompt is not None:
        kwargs["prompt"] = prompt
    if stream is not None:
        kwargs["stream"] = stream
    return kwargs


def audio_form(kwargs: dict[str, Any]) -> tuple[dict[str, str], dict[str, tuple[str, bytes, str]]]:
    """``transcription_kwargs`` as httpx's ``data=`` and ``files=``, for what the typed client cannot send (a stream
    on /v1/audio/translations, vLLM's extra fields) or cannot show (the raw server-sent events). Values are sent as
    the openai client sends form fields: booleans lower-case, numbers as text."""
    data = {
        name: (str(value).lower() if isinstance(value, bool) else str(value))
        for name, value in kwargs.items()
        if name != "file"
    }
    return data, {"file": kwargs["file"]}


def test_image(seed: int, size: int = 96) -> Image.Image:
    """A deterministic picture per seed: quadrants of seed-dependent colours, so two seeds differ."""
    img = Image.new("RGB", (size, size))
    half = size // 2
    for i, (x, y) in enumerate([(0, 0), (half, 0), (0, half), (half, half)]):
        v = (seed * 97 + i * 61) % 256
        colour = (v, (v * 3 + 85) % 256, (255 - v + i * 40) % 256)
        img.paste(colour, (x, y, x + half, y + half))
    return img


test_image.__test__ = False  # a builder, not a pytest test (tests import it by name)


def image_data_url(image: Image.Image | bytes, mime: str = "image/png") -> str:
    """A ``data:`` URL; PIL images are encoded as PNG, raw bytes are sent as they are."""
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        image = buf.getvalue()
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def image_chat_kwargs(
    images: list[Image.Image | bytes | str],
    *,
    model: str,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 16,
    temperature: float = 0.0,
    stream: bool = False,
    n: int | None = None,
) -> dict[str, Any]:
    """Arguments for ``client.chat.completions.create``: one user turn, the images then the prompt.

    A ``str`` image is used as the URL itself (lets callers send malformed data URLs on purpose).
    """
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": img if isinstance(img, str) else image_data_url(img)}}
        for img in images
    ]
    content.append({"type": "text", "text": prompt})
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }
    if n is not None:
        kwargs["n"] = n
    return kwargs


# --- audio files in other containers, made in-process (libsndfile: no ffmpeg, no sox) --------------
AUDIO_FORMATS = {  # name: (soundfile format, subtype, MIME type)
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "ogg": ("OGG", "VORBIS", "audio/ogg"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
}


def audio_file(seconds: float, fmt: str = "wav", *, sample_rate: int = 16000, tone_hz: float | None = 440.0) -> bytes:
    """A mono clip (a quiet tone, or silence with ``tone_hz=None``) encoded as ``fmt`` (wav/flac/ogg/mp3)."""
    t = np.arange(int(round(seconds * sample_rate)), dtype=np.float32) / sample_rate
    samples = 0.3 * np.sin(2 * np.pi * tone_hz * t) if tone_hz else np.zeros_like(t)
    major, subtype, _mime = AUDIO_FORMATS[fmt]
    buf = io.BytesIO()
    # In blocks of a minute: libsndfile's Vorbis encoder crashes on one write of many minutes.
    with soundfile.SoundFile(buf, "w", sample_rate, 1, format=major, subtype=subtype) as out:
        block = 60 * sample_rate
        for start in range(0, len(samples), block):
            out.write(samples[start : start + block].astype(np.float32))
    return buf.getvalue()


@functools.lru_cache(maxsize=4)
def long_silence(seconds: float, fmt: str, sample_rate: int = 8000) -> bytes:
    """``audio_file`` of silence, built once per process (minutes of audio take seconds to encode)."""
    return audio_file(seconds, fmt, sample_rate=sample_rate, tone_hz=None)


def audio_mime(fmt: str) -> str:
    return AUDIO_FORMATS[fmt][2]


# --- images whose header says more than their bytes hold ----------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A valid-looking PNG (8-bit greyscale) that *declares* width x height but carries one short row of
    pixel data: a few dozen bytes, whatever the size claimed (a decompression-bomb probe)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * min(width + 1, 1024))
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def jpeg_declaring(width: int, height: int) -> bytes:
    """A real 8x8 JPEG whose frame header (SOF0) is rewritten to claim width x height (each <= 65535)."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)  # after marker(2) length(2) precision(1)
    return bytes(data)


# --- requests the openai client cannot express: exact bytes for httpx ----------------------------
@dataclass(frozen=True)
class RawRequest:
    """One HTTP request as bytes: ``httpx.request(method, base_url + path, content=body, headers=headers)``."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"


def raw_json(path: str, payload: Any) -> RawRequest:
    """A JSON body exactly as given (e.g. a ``model`` that is a number, which the typed client forbids)."""
    return RawRequest(path, json.dumps(payload).encode(), {"Content-Type": "application/json"})


def raw_multipart(
    path: str, fields: dict[str, str], files: dict[str, tuple[str, bytes, str]] | None = None
) -> RawRequest:
    """A multipart/form-data body built byte by byte (fields, then files as (filename, data, MIME type))."""
    boundary = uuid.uuid5(uuid.NAMESPACE_URL, repr(sorted(fields.items()))).hex  # deterministic bytes
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    for name, (filename, data, mime) in (files or {}).items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        parts.append(f"{head}Content-Type: {mime}\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return RawRequest(path, b"".join(parts), {"Content-Type": f"multipart/form-data; boundary={boundary}"})


# --- images whose pixels are far more than their bytes (decompression bombs), real or declared -----------------
def _patched_png(data: bytes, kind: bytes, patch: Callable[[bytes], bytes]) -> bytes:
    """``data`` (a PNG) with the first chunk of ``kind`` rewritten by ``patch`` and its CRC recomputed."""
    at = data.index(kind) - 4
    (length,) = struct.unpack(">I", data[at : at + 4])
    body = patch(data[at + 8 : at + 8 + length])
    return data[:at] + _png_chunk(kind, body) + data[at + 12 + length :]


def _frames(count: int, size: tuple[int, int]) -> list[Image.Image]:
    # Frames that differ, so no encoder merges them.
    return [Image.new("RGB", size, ((i * 7) % 256, (i * 13) % 256, (i * 29) % 256)) for i in range(count)]


def apng_declaring(width: int, height: int, frames: int) -> bytes:
    """A real 2-frame 8x8 APNG whose IHDR claims width x height and whose acTL claims ``frames`` frames."""
    buf = io.BytesIO()
    first, *rest = _frames(2, (8, 8))
    first.save(buf, format="PNG", save_all=True, append_images=rest)
    data = _patched_png(buf.getvalue(), b"IHDR", lambda body: struct.pack(">II", width, height) + body[8:])
    return _patched_png(data, b"acTL", lambda body: struct.pack(">I", frames) + body[4:])


def gif_declaring(width: int, height: int, frames: int) -> bytes:
    """A real GIF of ``frames`` 8x8 frames whose logical screen claims width x height (each <= 65535): PIL decodes
    every frame onto a canvas of the screen's size."""
    buf = io.BytesIO()
    first, *rest = _frames(frames, (8, 8))
    first.save(buf, format="GIF", save_all=True, append_images=rest, duration=10)
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def webp_declaring(width: int, height: int, frames: int = 1) -> bytes:
    """A real lossless WebP of ``frames`` 8x8 frames whose VP8X canvas claims width x height (each <= 16384)."""
    buf = io.BytesIO()
    first, *rest = _frames(frames, (8, 8))
    first.save(buf, format="WEBP", save_all=bool(rest), append_images=rest, lossless=True)
    data = bytearray(buf.getvalue())
    if data[12:16] == b"VP8X":  # extended (animated): the canvas, 24 bits each, minus one
        data[24:27] = (width - 1).to_bytes(3, "little")
        data[27:30] = (height - 1).to_bytes(3, "little")
    else:  # simple lossless (VP8L): 14 bits each, minus one, then alpha and version bits kept
        assert data[12:16] == b"VP8L", data[12:16]
        (bits,) = struct.unpack("<I", data[21:25])
        data[21:25] = struct.pack("<I", (bits & ~0x0FFFFFFF) | (width - 1) | (height - 1) << 14)
    return bytes(data)


@functools.lru_cache(maxsize=8)
def png_bomb(width: int, height: int | None = None) -> bytes:
    """A REAL width x height (default square) 1-bit PNG of one colour: every pixel is there, and zlib makes it tiny
    (13000 px: ~20 KB that decode to ~480 MiB of RGB)."""
    buf = io.BytesIO()
    Image.new("1", (width, height or width)).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def image_bytes(fmt: str, size: int = 16) -> bytes:
    """A small picture saved in any format PIL writes (BMP, TIFF, ICO, ...)."""
    buf = io.BytesIO()
    test_image(1, size).save(buf, format=fmt)
    return buf.getvalue()


@functools.lru_cache(maxsize=8)
def jpeg_bomb(side: int) -> bytes:
    """A REAL side x side JPEG (grey, one colour: a few hundred KB at 8000 px)."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, format="JPEG", quality=1)
    return buf.getvalue()


def wav_declaring(sample_rate: int, seconds_of_data: float = 1.0, claimed_bytes: int | None = None) -> bytes:
    """A 16-bit mono WAV at ``sample_rate`` Hz (a very low rate makes a few KB last hours, and resampling to the
    model's 16 kHz multiplies it), optionally with a data chunk that claims ``claimed_bytes``."""
    samples = np.zeros(max(1, int(sample_rate * seconds_of_data)), dtype=np.int16)
    buf = io.BytesIO()
    soundfile.write(buf, samples, sample_rate, format="WAV", subtype="PCM_16")
    data = bytearray(buf.getvalue())
    if claimed_bytes is not None:
        at = data.index(b"data") + 4
        data[at : at + 4] = struct.pack("<I", claimed_bytes)
    return bytes(data)


# --- realtime transcription (/v1/realtime) ----------------------------------------------------------------------
SERVER_VAD = {"type": "server_vad"}  # OpenAI's defaults: threshold 0.5, prefix_padding_ms 300, silence_duration_ms 500


def realtime_session(
    model: str | None,
    *,
    rate: int = 24_000,
    language: str | None = None,
    prompt: str | None = None,
    turn_detection: dict[str, Any] | None = SERVER_VAD,
) -> dict[str, Any]:
    """``session`` of a GA ``session.update`` for a transcription session (``conn.session.update(session=...)``)."""
    transcription = {
        "model": model,
        **({"language": language} if language else {}),
        **({"prompt": prompt} if prompt else {}),
    }
    return {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": rate},
                "transcription": transcription,
                "turn_detection": turn_detection,
            }
        },
    }


def realtime_beta_session(model: str | None, *, turn_detection: dict[str, Any] | None = SERVER_VAD) -> dict[str, Any]:
    """``session`` of a beta ``transcription_session.update`` (24 kHz pcm16)."""
    return {
        "input_audio_format": "pcm16",
        "input_audio_transcription": {"model": model},
        "turn_detection": turn_detection,
    }


def pcm16_base64(samples: np.ndarray) -> str:
    """``input_audio_buffer.append``'s ``audio``: little-endian 16-bit PCM, base64."""
    return base64.b64encode(np.asarray(samples, dtype="<i2").tobytes()).decode()
