"""Views of raw device pointers: some MRV2 kernels take tables of addresses (uint64 tensors).

On CPU a "device pointer" is a host address, so the memory behind it can be wrapped without a copy, through
numpy's array interface (~1 us; a ctypes array type per size would cost tens of us and is cached forever).
The caller says how many elements it needs (stride x (max index + 1)), which is what the kernel may touch.
"""

from __future__ import annotations

import numpy as np
import torch

_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8", torch.float32: "<f4", torch.uint8: "|u1"}
# Same-width unsigned integers, for the torch dtypes numpy cannot name (bfloat16, ...): viewed back after.
_BITS = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


class _Memory:
    """Raw memory described by numpy's array interface, so ``np.asarray`` can wrap it without a copy."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, typestr: str, numel: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (numel,), "typestr": typestr, "version": 3}


def array(addr: int, dtype: torch.dtype, numel: int) -> np.ndarray:
    """The ``numel`` ``dtype`` elements at ``addr`` as a writable 1-D numpy view (int32/int64/float32/uint8)."""
    return np.asarray(_Memory(int(addr), _TYPESTR[dtype], max(numel, 0)))


def view(addr: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The same memory as a 1-D torch tensor of any dtype (writes go through)."""
    width = torch.empty((), dtype=dtype).element_size()
    raw = np.asarray(_Memory(int(addr), _BITS[width], max(numel, 0)))
    return torch.from_numpy(raw).view(dtype)
