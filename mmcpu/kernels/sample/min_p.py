"""Native ``vllm/v1/worker/gpu/sample/min_p.py``."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.sample.min_p",
    "_min_p_kernel",
    sha256="bd9d4defbc342db931a975ac0707f01e4d40cf3764173324f3aaa9a29547ae95",
)
def _min_p_kernel(grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, min_p_ptr, vocab_size, BLOCK_SIZE):
    # One program per token row: drop logits below max + log(min_p) (in fp32), in place; min_p == 0 rows untouched.
    num_tokens = grid[0]
    min_p = min_p_ptr[expanded_idx_mapping_ptr[:num_tokens].long()].float()
    rows = (min_p != 0.0).nonzero().flatten()
    if rows.numel() == 0:
        return
    logits = logits_ptr.as_strided((num_tokens, vocab_size), (logits_stride, 1))
    sel = logits[rows]
    threshold = sel.max(dim=1, keepdim=True).values.float() + torch.log(min_p[rows]).unsqueeze(1)
    logits[rows] = torch.where(sel < threshold, float("-inf"), sel)
