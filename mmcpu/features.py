"""Whisper's log-mel features without paying for the padding.

Whisper's feature extractor (transformers' ``WhisperFeatureExtractor``) pads every clip with zeros to 30 s and
computes the STFT and the mel projection over all 3000 frames, so a 2 s clip (a realtime turn, an interim decode)
costs as much as a full window. A frame whose window holds only zeros has a zero spectrum, so its log-mel value,
after the extractor's clamp, maximum and scaling, is the same for every such frame and depends only on the clip's
largest value. :func:`trimmed` computes the frames up to the last non-zero sample plus a margin that ends in at
least one all-zero frame (with the extractor's own code, on the shorter input), then repeats that frame's column
for the rest. Each frame's STFT and mel column only read that frame's samples, so the result is the original's,
bit for bit (``tests/test_features.py`` checks it against the original on random clips, lengths and batches).

Installed by mmcpu's vLLM plugin (:func:`mmcpu.plugin.register`) in every vLLM process, so the API server's
multimodal processor and :mod:`mmcpu.whisper_align` both use it. Dithering (``dither != 0``, noise over the whole
padded clip) and other devices keep the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

ATTRIBUTE = "_torch_extract_fbank_features"
Fbank = Callable[..., np.ndarray]


def trimmed(original: Fbank) -> Fbank:
    """``original`` (the extractor's ``_torch_extract_fbank_features``) computing only the frames that can hold
    anything but the value of silence."""

    def fbank(self: Any, waveform: np.ndarray, device: str = "cpu") -> np.ndarray:
        total = waveform.shape[-1]
        hop, n_fft = self.hop_length, self.n_fft
        if self.dither != 0.0 or device != "cpu" or total % hop:
            return original(self, waveform, device)
        nonzero = np.flatnonzero(np.any(waveform.reshape(-1, total) != 0, axis=0))
        last = int(nonzero[-1]) + 1 if nonzero.size else 0
        # Keep every frame whose window (centred: hop * t +- n_fft / 2) reaches a non-zero sample, and then at least
        # one frame whose window and reflected end padding are all zeros: the value of silence, computed as the
        # original computes it.
        keep = hop * (-(-(last + n_fft) // hop) + 2)
        if keep >= total:
            return original(self, waveform, device)
        head = original(self, np.ascontiguousarray(waveform[..., :keep]), device)
        frames = total // hop
        out = np.empty((*head.shape[:-1], frames), dtype=head.dtype)
        out[..., : head.shape[-1]] = head
        out[..., head.shape[-1] :] = head[..., -1:]
        return out

    fbank.__wrapped__ = original  # type: ignore[attr-defined]
    fbank._mmcpu_trimmed = True  # type: ignore[attr-defined]
    return fbank


def install(module: Any) -> None:
    """Wrap ``WhisperFeatureExtractor``'s torch log-mel in ``module`` (transformers' Whisper feature extraction
    module) with :func:`trimmed` (idempotent; a transformers without it is left alone)."""
    cls = getattr(module, "WhisperFeatureExtractor", None)
    original = getattr(cls, ATTRIBUTE, None)
    if cls is None or original is None or getattr(original, "_mmcpu_trimmed", False):
        return
    setattr(cls, ATTRIBUTE, trimmed(original))
