"""Native ``vllm/v1/worker/gpu/sample/logprob.py``: log-softmax at given token ids, ranks, logprob token ids."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view of ``t``'s memory from its first element to the end of its storage (the kernel's pointer)."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))


@native(
    "vllm.v1.worker.gpu.sample.logprob",
    "_topk_log_softmax_kernel",
    sha256="535eb7c043dbb1dc96a94c7cc74d2fa6640d697909fa707ba69e7dffdd1251a5",
)
def _topk_log_softmax_kernel(
    grid,
    output_ptr,
    logits_ptr,
    logits_stride,
    topk_ids_ptr,
    topk_ids_stride,
    topk,
    vocab_size,
    BLOCK_SIZE,
    TOPK_BLOCK_SIZE,
):
    # Per row: logits[ids] - max - log(sum(exp(logits - max))), all in fp32; ids are [rows, topk] with row stride
    # topk_ids_stride, the output [rows, topk] contiguous.
    num_rows = grid[0]
    if num_rows == 0 or topk <= 0:
        return
    logits = logits_ptr.as_strided((num_rows, vocab_size), (logits_stride, 1))
    # The kernel's running max ignores NaNs (interpreter: numpy.nanmax) unless a whole block is NaN, but a row
    # holding any NaN gets a NaN sum of exps and so NaN everywhere: torch's NaN-propagating amax gives the same.
    max_val = logits.amax(dim=1, keepdim=True).float()
    e = logits - max_val  # a new fp32 tensor (bf16 - fp32 promotes): the caller's logits stay untouched
    lse = e.exp_().sum(dim=1, keepdim=True).log_()
    ids = topk_ids_ptr.as_strided((num_rows, topk), (topk_ids_stride, 1)).long()
    picked = logits.gather(1, ids).float()
    output_ptr.as_strided((num_rows, topk), (topk, 1)).copy_(picked - max_val - lse)


@native(
    "vllm.v1.worker.gpu.sample.logprob",
    "_ranks_kernel",
    sha256="9bb31889efc6e89247fd251a05fa16bb7aa0c72eada787f4967ce088c1d7c56b",
)
def _ranks_kernel(grid, output_ptr, logits_ptr, logits_stride, token_ids_ptr, vocab_size, BLOCK_SIZE):
    # Per row: how many logits are >= the token's own logit (compared in the logits' dtype).
    num_rows = grid[0]
    if num_rows == 0:
        return
    logits = logits_ptr.as_strided((num_rows, vocab_size), (logits_stride, 1))
    x = logits.gather(1, _flat(token_ids_ptr)[:num_rows].long().unsqueeze(1))
    n = (logits >= x).sum(dim=1)
    # The kernel also counts its masked tail (loaded as -inf) when the token's logit is -inf itself.
    pad = -(-vocab_size // BLOCK_SIZE) * BLOCK_SIZE - vocab_size
    if pad:
        n += (x.squeeze(1) == float("-inf")).long() * pad
    _flat(output_ptr)[:num_rows].copy_(n)


@native(
    "vllm.v1.worker.gpu.sample.logprob",
    "_fill_logprob_token_ids_kernel",
    sha256="a73ab01163401faa32fb65c370548e6c85313cfb779e81d6f1370b3b7396b961",
)
def _fill_logprob_token_ids_kernel(
    grid,
    out_token_ids_ptr,
    out_token_ids_stride,
    out_valid_mask_ptr,
    out_valid_mask_stride,
    sampled_token_ids_ptr,
    topk_indices_ptr,
    topk_indices_stride,
    expanded_idx_mapping_ptr,
    num_per_req_token_ids_ptr,
    per_req_token_ids_ptr,
    per_req_token_ids_stride,
    NUM_TOPK,
    PADDED_COLS,
):
    # Column 0: the sampled token (valid); columns 1..: the request's custom token ids if it has any, else top-k.
    num_rows = grid[0]
    if num_rows == 0:
        return
    out, valid_out = _flat(out_token_ids_ptr), _flat(out_valid_mask_ptr)
    rows = torch.arange(num_rows)
    out[rows * out_token_ids_stride] = _flat(sampled_token_ids_ptr)[:num_rows].to(out.dtype)
    valid_out[rows * out_valid_mask_stride] = True

    req = _flat(expanded_idx_mapping_ptr)[:num_rows].long()
    num_custom = _flat(num_per_req_token_ids_ptr)[req].long()
    custom = num_custom > 0
    count = torch.where(custom, num_custom, NUM_TOPK).clamp(max=PADDED_COLS)
    width = int(count.max())
    if width <= 0:
        return
    col = torch.arange(width)
    valid = col < count.unsqueeze(1)  # [rows, width]
    # Source addresses of each (row, col): the custom table's row, or this row of the top-k indices.
    src_custom = req.unsqueeze(1) * per_req_token_ids_stride + col
    src_topk = rows.unsqueeze(1) * topk_indices_stride + col
    r, c = valid.nonzero(as_tuple=True)
    is_custom = custom[r]
    tokens = torch.empty(r.numel(), dtype=out.dtype)
    if bool(is_custom.any()):
        tokens[is_custom] = _flat(per_req_token_ids_ptr)[src_custom[r[is_custom], c[is_custom]]].to(out.dtype)
    if not bool(is_custom.all()):
        plain = ~is_custom
        tokens[plain] = _flat(topk_indices_ptr)[src_topk[r[plain], c[plain]]].to(out.dtype)
    out[r * out_token_ids_stride + 1 + c] = tokens
    valid_out[r * out_valid_mask_stride + 1 + c] = True
