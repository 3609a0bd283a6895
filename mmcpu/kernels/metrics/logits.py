"""Native ``vllm/v1/worker/gpu/metrics/logits.py``: per-row NaN count (``VLLM_COMPUTE_NANS_IN_LOGITS``)."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.metrics.logits",
    "_num_nans_kernel",
    sha256="fefae6b2fd82eaffb82020ee7611a303f939c7a4130b80fd351c51282fbbc2bd",
)
def _num_nans_kernel(grid, logits_ptr, logits_stride, num_nans_ptr, vocab_size, BLOCK_SIZE):
    # One program per row: count NaNs among the first vocab_size logits (the fp32 upcast keeps NaN as NaN).
    num_rows = grid[0]
    if num_rows <= 0:
        return
    logits = logits_ptr.as_strided((num_rows, vocab_size), (logits_stride, 1))
    num_nans_ptr[:num_rows] = logits.isnan().sum(dim=1, dtype=torch.int32).to(num_nans_ptr.dtype)
