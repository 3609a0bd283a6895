"""Native ``vllm/v1/worker/gpu/buffer_utils.py`` (``_apply_write_kernel``), plus the host-array helpers the
bookkeeping kernels of ``block_table.py`` and ``input_batch.py`` share.

These kernels move a few dozen integers per step. They work on zero-copy numpy views of the torch tensors the
launcher passed: numpy's per-operation cost on such small arrays is a tenth of torch's, and writes go straight
into the tensors' memory. Indexing is flat, from a tensor's first element, as a Triton pointer sees it.
"""

from __future__ import annotations

import numpy as np
import torch

from mmcpu.kernels.dispatch import native
from mmcpu.kernels.ptr import array as table


def flat(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as a kernel pointer sees it: a 1-D numpy view starting at its first element (strides ignored)."""
    if t.is_contiguous():
        a = t.numpy()
        return a if a.ndim == 1 else a.reshape(-1)
    # A strided view: the pointer still addresses the storage linearly, up to its end.
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,)).numpy()


def segments(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For per-program element counts ``lens`` (>= 0): each element's program and its offset within it."""
    total = int(lens.sum())
    seg = np.repeat(np.arange(lens.shape[0]), lens)
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    return seg, within


def tdiv(a: np.ndarray, b) -> np.ndarray:
    """Integer division truncating toward zero, as Triton (and its interpreter) divide."""
    return (a - np.fmod(a, b)) // b


def _overlap(base: np.ndarray, lens: np.ndarray) -> bool:
    """Whether any two of the ranges [base, base + lens) share an element."""
    keep = lens > 0
    if int(keep.sum()) < 2:
        return False
    b, e = base[keep], base[keep] + lens[keep]
    order = np.argsort(b, kind="stable")
    return bool((e[order][:-1] > b[order][1:]).any())


def _copy_ranges(out: np.ndarray, base: np.ndarray, contents: np.ndarray, src: np.ndarray, lens: np.ndarray) -> None:
    # Program i copies contents[src[i] : src[i] + lens[i]] to out[base[i] : ...].
    if _overlap(base, lens):
        # Programs run in order, so a later write wins; a fancy-index store would not promise that.
        for b, s, n in zip(base.tolist(), src.tolist(), lens.tolist(), strict=False):
            out[b : b + n] = contents[s : s + n]
        return
    seg, within = segments(lens)
    out[base[seg] + within] = contents[src[seg] + within]


@native(
    "vllm.v1.worker.gpu.buffer_utils",
    "_apply_write_kernel",
    sha256="7ead8dc875acc47c2c39d652856ebe7771f4ce2e2de3b1e1e5eb07cdbc4f8f59",
)
def _apply_write_kernel(
    grid,
    output_ptr,
    output_stride,
    write_indices_ptr,
    write_starts_ptr,
    write_contents_ptr,
    write_cu_lens_ptr,
    write_group_ids_ptr,
    BLOCK_SIZE,
    MULTI_GROUP,
):
    # Program pid copies contents[cu_lens[pid-1] : cu_lens[pid]] to row indices[pid] at column starts[pid]
    # (flat: row * stride + start, so a long write runs on into the next row, as the kernel's does).
    n = grid[0]
    if n <= 0:
        return
    rows = flat(write_indices_ptr)[:n].astype(np.int64)
    starts = flat(write_starts_ptr)[:n].astype(np.int64)
    cu_end = flat(write_cu_lens_ptr)[:n].astype(np.int64)
    cu_start = np.concatenate((np.zeros(1, np.int64), cu_end[:-1]))
    lens = np.maximum(cu_end - cu_start, 0)  # range(0, negative) runs no iteration
    if not lens.any():
        return
    contents = flat(write_contents_ptr)
    if not MULTI_GROUP:
        out = flat(output_ptr)
        _copy_ranges(out, rows * int(output_stride) + starts, contents.astype(out.dtype, copy=False), cu_start, lens)
        return
    # Fused path: each write names its KV-cache group; the group's int32 table is reached through a pointer.
    gids = flat(write_group_ids_ptr)[:n].astype(np.int64)
    addrs, strides = flat(output_ptr), flat(output_stride)
    contents = contents.astype(np.int32, copy=False)
    for g in np.unique(gids[lens > 0]).tolist():
        sel = (gids == g) & (lens > 0)
        base = rows[sel] * int(strides[g]) + starts[sel]
        numel = int((base + lens[sel]).max())
        _copy_ranges(table(addrs[g], torch.int32, numel), base, contents, cu_start[sel], lens[sel])
