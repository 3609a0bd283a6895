"""Whisper's encoder outputs kept for the word alignment, in the engine worker.

The alignment of a window (:mod:`mmcpu.whisper_align`) needs the encoder's output over that window's log-mel
features: the decode of the same window computed it moments before, in the same worker. vLLM's own encoder cache
drops it once the decode's request ends, so the worker keeps its own: :func:`install` (called by mmcpu's vLLM plugin
once vLLM's CPU worker module is imported, i.e. only in a process that builds a CPU worker) wraps
``WhisperModel.get_encoder_outputs`` - the encoder entry MRV2's encoder runner reaches through
``WhisperForConditionalGeneration.embed_multimodal`` - so that every window it encodes is also stored in
:data:`STASH`, keyed by a hash of the features exactly as the encoder receives them (the processor's float32
features cast to the model's dtype: bytes, shape and dtype). The alignment casts its own copy of those features
(the API server's memoised log-mel: the same float32 values, :mod:`mmcpu.features`) the same way and looks the key up
(:func:`encoder_output`); on a miss it runs the encoder as before. A decode of several windows in one batch stores
each window's row; its values may differ from a lone window's encoding by float rounding only.

Bound: :data:`MAX_WINDOWS` outputs and :data:`MAX_BYTES`, least recently used first out. An output is
1500 frames x d_model in the model's dtype (tiny: 2.3 MB in float32; large-v3: 3.8 MB in bfloat16, 7.7 MB in
float32). A window's alignment follows its decode; in between the engine encodes the windows of the requests admitted
meanwhile (8 concurrent three-window requests: 24), so 32 windows keep them, and the byte cap holds large models to
256 MiB. A miss costs one encoder pass, as before.

A vLLM without ``WhisperModel.get_encoder_outputs`` serves unchanged (every alignment misses) and says so in one log
line.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections import OrderedDict
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.mmcpu.encoder_stash")

MODEL_MODULE = "vllm.model_executor.models.whisper"
ENTRY = "get_encoder_outputs"
STATS_METHOD = "mmcpu_encoder_stash_stats"  # the CPU worker method returning :meth:`Stash.stats`
MAX_WINDOWS = 32
MAX_BYTES = 256 * 2**20


class Stash:
    """Encoder outputs by feature hash (thread-safe), least recently used first out."""

    def __init__(self, max_items: int = MAX_WINDOWS, max_bytes: int = MAX_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[bytes, Any] = OrderedDict()
        self.bytes = self.hits = self.misses = self.stored = 0
        self.lock = threading.Lock()

    def get(self, key: bytes) -> Any:
        with self.lock:
            value = self.items.get(key)
            if value is None:
                self.misses += 1
                return None
            self.items.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, value: Any) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        with self.lock:
            old = self.items.pop(key, None)
            if old is not None:
                self.bytes -= old.numel() * old.element_size()
            self.items[key] = value
            self.bytes += size
            self.stored += 1
            while len(self.items) > self.max_items or self.bytes > self.max_bytes:
                _, dropped = self.items.popitem(last=False)
                self.bytes -= dropped.numel() * dropped.element_size()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "stored": self.stored,
                "windows": len(self.items),
                "bytes": self.bytes,
            }

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.bytes = self.hits = self.misses = self.stored = 0


STASH = Stash()


def key(features: Any) -> bytes:
    """A hash of one window's features as the encoder receives them (a 2-D tensor: mel bins x frames)."""
    flat = features.detach().contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=20)
    digest.update(repr((tuple(features.shape), str(features.dtype))).encode())
    digest.update(flat.view(dtype=_uint8()).numpy().data)  # raw bytes, whatever the dtype (numpy has no bfloat16)
    return digest.digest()


def _uint8() -> Any:
    import torch

    return torch.uint8


def windows(input_features: Any) -> list[Any]:
    """The encoder's input as its windows, in the order of its output's rows (``WhisperEncoder.forward`` takes a
    batched tensor or a list of 2-D or batched tensors)."""
    out: list[Any] = []
    for features in input_features:
        out.extend([features] if features.dim() == 2 else list(features.unbind(0)))
    return out


def stashing(get_encoder_outputs: Any, stash: Stash = STASH) -> Any:
    """``WhisperModel.get_encoder_outputs`` storing each window's output in ``stash``."""

    @functools.wraps(get_encoder_outputs)
    def wrapped(self: Any, input_features: Any, *args: Any, **kwargs: Any) -> Any:
        out = get_encoder_outputs(self, input_features, *args, **kwargs)
        if out is None or input_features is None:
            return out
        rows = windows(input_features)
        if out.dim() == 3 and out.shape[0] == len(rows):
            for features, hidden in zip(rows, out, strict=True):
                # A copy: a row view would keep the whole batch's output alive (and outside the byte count).
                stash.put(key(features), hidden.clone())
        return out

    wrapped._mmcpu_stashing = True  # type: ignore[attr-defined]
    return wrapped


def encoder_output(whisper_model: Any, features: Any, stash: Stash = STASH) -> tuple[Any, bool]:
    """The encoder's output (frames x d_model) over one window's ``features`` (already in the model's dtype) from
    ``stash`` when the decode left it there, else computed; and whether it was found."""
    found = stash.get(key(features))
    if found is not None:
        return found, True
    return whisper_model.get_encoder_outputs([features])[0], False


def add_stash(module: ModuleType) -> None:
    """Wrap ``WhisperModel.get_encoder_outputs`` of vLLM's Whisper module (idempotent)."""
    cls = getattr(module, "WhisperModel", None)
    entry = getattr(cls, ENTRY, None)
    if cls is None or not callable(entry):
        logger.warning(
            "mmcpu: this vLLM's %s has no WhisperModel.%s: word alignment recomputes the encoder (mmcpu/encoder_stash)",
            MODEL_MODULE,
            ENTRY,
        )
        return
    if not getattr(entry, "_mmcpu_stashing", False):
        setattr(cls, ENTRY, stashing(entry))


def worker_stats(worker: Any) -> dict[str, int]:
    """vLLM's CPU worker method :data:`STATS_METHOD`: this worker's :meth:`Stash.stats`."""
    return STASH.stats()


def install(worker_module: ModuleType) -> None:
    """Once vLLM's CPU worker module is imported: the stash around the Whisper encoder (now or when the model's module
    is imported) and the worker's :data:`STATS_METHOD`."""
    from mmcpu.plugin import after_import

    cls = getattr(worker_module, "CPUWorker", None)
    if cls is not None and not hasattr(cls, STATS_METHOD):
        setattr(cls, STATS_METHOD, worker_stats)
    after_import(MODEL_MODULE, add_stash)
