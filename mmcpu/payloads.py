"""The one way to build requests: used by the tests, the compose smoke check and the benchmarks.

Each builder returns keyword arguments for the unmodified ``openai`` client, e.g.
``client.audio.transcriptions.create(**transcription_kwargs(...))``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from PIL import Image

DEFAULT_PROMPT = "Describe the two images."


def transcription_kwargs(
    audio: Path | bytes,
    *,
    model: str,
    language: str | None = None,
    response_format: str = "json",
    filename: str = "speech.wav",
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Arguments for ``client.audio.transcriptions.create``; ``language=None`` leaves the field out."""
    data = audio.read_bytes() if isinstance(audio, Path) else audio
    if isinstance(audio, Path):
        filename = audio.name
    kwargs: dict[str, Any] = {
        "model": model,
        "file": (filename, data, "audio/wav"),
        "response_format": response_format,
        "temperature": temperature,
    }
    if language is not None:
        kwargs["language"] = language
    return kwargs


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
) -> dict[str, Any]:
    """Arguments for ``client.chat.completions.create``: one user turn, the images then the prompt.

    A ``str`` image is used as the URL itself (lets callers send malformed data URLs on purpose).
    """
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": img if isinstance(img, str) else image_data_url(img)}}
        for img in images
    ]
    content.append({"type": "text", "text": prompt})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }
