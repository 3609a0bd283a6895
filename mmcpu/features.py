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

The installed function also remembers its last results (:func:`memoised`): the word alignment of a window asks for
the log-mel features the multimodal processor computed for that window's decode moments before, in the same API
server process, and gets a copy of them instead of a second STFT. The key is a hash of the padded waveform the
extractor hands over (its bytes, shape and dtype), the device and the extractor's own parameters (FFT size, hop,
mel filters), so a different clip or anything in the call that changes the waveform (``do_normalize``, another
length) misses; arguments that only change the wrapping (``return_tensors``) hit. At most :data:`MEMO_BYTES`
of results are kept, least recently used first out.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

ATTRIBUTE = "_torch_extract_fbank_features"
Fbank = Callable[..., np.ndarray]
# 64 MiB: 66 windows of 80 mel bins (0.96 MB each), 43 of 128. A window's alignment asks for its features after the
# window's decode; meanwhile the server processes the windows of every request admitted in between (8 concurrent
# requests of three windows: 24), so this keeps them with room to spare, and a miss only costs the recomputation.
MEMO_BYTES = 64 * 2**20


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


class Memo:
    """Results by key, least recently used first out beyond ``max_bytes`` (thread-safe: the event loop's thread and
    the serving's executor both compute features)."""

    def __init__(self, max_bytes: int = MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.bytes = self.hits = self.misses = 0
        self.lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        with self.lock:
            value = self.items.get(key)
            if value is None:
                self.misses += 1
                return None
            self.items.move_to_end(key)
            self.hits += 1
            return value.copy()  # the caller owns its array (transformers hands it to the user as is)

    def put(self, key: bytes, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self.lock:
            old = self.items.pop(key, None)
            self.bytes -= 0 if old is None else old.nbytes
            self.items[key] = value.copy()
            self.bytes += value.nbytes
            while self.bytes > self.max_bytes:
                _, dropped = self.items.popitem(last=False)
                self.bytes -= dropped.nbytes

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.bytes = self.hits = self.misses = 0


MEMO = Memo()


def memo_key(extractor: Any, waveform: np.ndarray, device: str) -> bytes:
    """A hash of everything the log-mel depends on: the waveform and the extractor's parameters."""
    digest = hashlib.blake2b(digest_size=20)
    waveform = np.ascontiguousarray(waveform)
    filters = np.ascontiguousarray(extractor.mel_filters)
    digest.update(repr((waveform.shape, waveform.dtype.str, device, extractor.n_fft, extractor.hop_length)).encode())
    digest.update(repr((filters.shape, filters.dtype.str)).encode())
    digest.update(filters.data)
    digest.update(waveform.data)  # no copy: the buffer itself
    return digest.digest()


def memoised(fbank: Fbank, memo: Memo = MEMO) -> Fbank:
    """``fbank`` answering a waveform it has seen lately from ``memo`` (a copy, bit for bit its earlier result)."""

    def remembered(self: Any, waveform: np.ndarray, device: str = "cpu") -> np.ndarray:
        if self.dither != 0.0:  # random noise: every call differs
            return fbank(self, waveform, device)
        key = memo_key(self, waveform, device)
        found = memo.get(key)
        if found is not None:
            return found
        out = fbank(self, waveform, device)
        memo.put(key, out)
        return out

    return remembered


def install(module: Any) -> None:
    """Wrap ``WhisperFeatureExtractor``'s torch log-mel in ``module`` (transformers' Whisper feature extraction
    module) with :func:`trimmed` and :func:`memoised` (idempotent; a transformers without it is left alone)."""
    cls = getattr(module, "WhisperFeatureExtractor", None)
    original = getattr(cls, ATTRIBUTE, None)
    if cls is None or original is None or getattr(original, "_mmcpu_trimmed", False):
        return
    installed = memoised(trimmed(original))
    installed.__wrapped__ = original  # type: ignore[attr-defined]
    installed._mmcpu_trimmed = True  # type: ignore[attr-defined]
    setattr(cls, ATTRIBUTE, installed)
