"""Native ``vllm/v1/worker/gpu/sample/prompt_logprob.py``: the prompt's next-token ids per scheduled token."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view of ``t``'s memory from its first element to the end of its storage (the kernel's pointer)."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))


@native(
    "vllm.v1.worker.gpu.sample.prompt_logprob",
    "_prompt_logprobs_token_ids_kernel",
    sha256="2706dbdcfea541d3b659a8c9d05f4d183eeae1c386e34a2843034f8771bb6aff",
)
def _prompt_logprobs_token_ids_kernel(
    grid,
    prompt_logprobs_token_ids_ptr,
    query_start_loc_ptr,
    idx_mapping_ptr,
    num_computed_tokens_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    BLOCK_SIZE,
):
    # out[query_start + j] = all_token_ids[req, num_computed + 1 + j] for j < query_len, per request.
    num_reqs = grid[0]
    if num_reqs == 0:
        return
    qsl = _flat(query_start_loc_ptr)[: num_reqs + 1].long()
    start = qsl[:-1]
    qlen = (qsl[1:] - start).clamp_min(0)
    total = int(qlen.sum())
    if total == 0:
        return
    req = _flat(idx_mapping_ptr)[:num_reqs].long()
    base = req * all_token_ids_stride + _flat(num_computed_tokens_ptr)[req].long() + 1
    # Token k of the concatenated queries belongs to request b at offset j = k - (offset of b's first token).
    b = torch.repeat_interleave(torch.arange(num_reqs), qlen, output_size=total)
    j = torch.arange(total) - (torch.cumsum(qlen, 0) - qlen)[b]
    src = base[b] + j
    table = _flat(all_token_ids_ptr)
    # The last prompt token's "next token" can sit one past the end of the table (the caller drops it); the
    # kernel reads whatever memory is there, here it reads 0.
    inside = src < table.numel()
    tokens = torch.where(inside, table[src.clamp(max=table.numel() - 1)], 0)
    out = _flat(prompt_logprobs_token_ids_ptr)
    out[start[b] + j] = tokens.to(out.dtype)
