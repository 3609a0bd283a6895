"""Size limits checked before decoding: encoded bytes per media item, and pixels per image with every frame counted.

PIL opens an image lazily: ``Image.open`` reads the container's header (size, mode, and for GIF, WebP and APNG the
frame count) and allocates no pixel memory (libwebp's canvas is calloc'd and stays untouched until a frame is
decoded). So the declared size is known, and refused, before vLLM's loader decodes anything. A 74-byte PNG declaring
30000x30000 is refused here in well under a millisecond, instead of holding 2.5 GiB of RGB.

Frames count because they are pixels a decoder may be asked for: a GIF of 1000 frames of 2000x2000 is 4 Gpx of
image data, though vLLM's image loader decodes only the first frame today.
"""

from __future__ import annotations

import io
import re

from PIL import Image
from vllm.exceptions import VLLMValidationError

# The image formats accepted: OpenAI's image inputs (PNG, JPEG, WEBP, GIF). PIL can open some forty more (vLLM's
# ALLOWED_IMAGE_FORMATS: FITS, SPIDER, PSD, ...): each is a decoder a client could aim at, for no client need.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")

UNDECODABLE = "The image could not be decoded: send a PNG, JPEG, WEBP or GIF file."


class OverLimit(VLLMValidationError):
    """A media item over a size limit: a 400 that names the limit's setting."""


def check_bytes(size: int, limit: int, *, param: str, at_least: bool = False) -> None:
    """Encoded bytes of one media item against MMCPU_MAX_MEDIA_MB."""
    if size > limit:
        more = "more than " if at_least else ""
        raise OverLimit(
            f"The media item is {more}{size} bytes, over this server's limit of {limit} bytes per item "
            f"(MMCPU_MAX_MEDIA_MB={limit / 2**20:g}).",
            parameter=param,
        )


def _over(pixels: int, max_pixels: int, what: str) -> OverLimit:
    return OverLimit(
        f"The image is {what}{pixels} pixels, over this server's limit of {max_pixels} pixels "
        "per image (MMCPU_MAX_IMAGE_PIXELS).",
        parameter="image_url",
    )


def check_image(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    """(width, height, frames) from the header alone, refused when width x height x frames exceeds ``max_pixels``
    or when the bytes are none of IMAGE_FORMATS (VLLMValidationError, 400)."""
    try:
        # (PIL warns above its own limit, 89 Mpx, and raises above twice that: the limit that counts is ours.)
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            frames = max(1, int(getattr(image, "n_frames", 1) or 1))
    except Image.DecompressionBombError as exc:
        # Over twice PIL's limit (179 Mpx), PIL refuses before the size can be read; its message has the count.
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        raise _over(int(declared.group(1)) if declared else max_pixels + 1, max_pixels, "") from None
    except Exception:
        raise VLLMValidationError(UNDECODABLE, parameter="image_url") from None
    pixels = width * height * frames
    if pixels > max_pixels:
        raise _over(pixels, max_pixels, f"{width}x{height}{f' x {frames} frames' if frames > 1 else ''} = ")
    return width, height, frames
