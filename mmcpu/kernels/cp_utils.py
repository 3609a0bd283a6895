"""Native ``vllm/v1/worker/gpu/cp_utils.py``: per-rank KV lengths under decode context parallelism (DCP)."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.cp_utils",
    "_dcp_local_seq_lens_kernel",
    sha256="06411f83f96e795b9ef16a74ec3cdc60dac6a715b35e08600070ddc0a2ad659f",
)
def _dcp_local_seq_lens_kernel(
    grid, out_ptr, seq_lens_ptr, dcp_size, dcp_rank, cp_interleave, num_reqs, max_num_reqs, BLOCK_SIZE
):
    # Programs cover [0, grid * BLOCK_SIZE) ∩ [0, max_num_reqs): this rank's share of each request's round-robin
    # (interleave-sized) KV slices; 0 past num_reqs.
    end = min(grid[0] * BLOCK_SIZE, max_num_reqs)
    if end <= 0:
        return
    n = max(min(num_reqs, end), 0)
    out = torch.zeros(end, dtype=out_ptr.dtype)
    if n:
        seq_lens = seq_lens_ptr[:n]
        span = dcp_size * cp_interleave
        # Triton's integer // and % truncate toward zero (C semantics), unlike torch's floor //.
        rounds = torch.div(seq_lens, span, rounding_mode="trunc")
        remainder = torch.fmod(seq_lens, span)
        remainder = (remainder - dcp_rank * cp_interleave).clamp_min(0).clamp_max(cp_interleave)
        out[:n] = rounds * cp_interleave + remainder
    out_ptr[:end] = out
