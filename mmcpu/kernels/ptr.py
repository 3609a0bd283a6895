"""Views of raw device pointers as tensors: some MRV2 kernels take tables of addresses (uint64 tensors).

On CPU a "device pointer" is a host address, so the memory behind it can be wrapped without a copy. The caller
says how many elements it needs (stride x (max index + 1)), which is exactly what the kernel may touch.
"""

from __future__ import annotations

import ctypes

import torch


def view(addr: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` ``dtype`` elements over the memory at ``addr`` (writes go through)."""
    if numel <= 0:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(int(addr)), dtype=dtype, count=numel)
