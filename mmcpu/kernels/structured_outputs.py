"""Native ``vllm/v1/worker/gpu/structured_outputs.py``: a grammar's packed token bitmask sets every
disallowed token's logit to -inf, in place."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _rows(t: torch.Tensor, stride: int, ncols: int) -> torch.Tensor:
    """``t`` addressed as ``ptr + row * stride + col`` (col < ncols): a writable 2-D view."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=False))
    return t.as_strided(((span - ncols) // stride + 1, ncols), (stride, 1))


_INT_OF = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


@native(
    "vllm.v1.worker.gpu.structured_outputs",
    "_apply_grammar_bitmask_kernel",
    sha256="1d93a33523d5a05f375198d30cdd0fd000ecab15f0fb6f864f50163f68b042fb",
)
def _apply_grammar_bitmask_kernel(
    grid,
    logits_ptr,
    logits_stride,
    logits_indices_ptr,
    cu_num_logits_ptr,
    bitmask_ptr,
    bitmask_stride,
    vocab_size,
    MASK_STRIDE,
    BLOCK_SIZE,
):
    # Mask i is keyed (request, position) = divmod(logits_indices[i], MASK_STRIDE); it applies to logits row
    # cu_num_logits[request] + position, and only if that position is within the request's logits.
    num_masks = grid[0]
    if num_masks == 0:
        return
    key = logits_indices_ptr[:num_masks].long()
    req = torch.div(key, MASK_STRIDE, rounding_mode="trunc")  # Triton's // and % truncate toward zero
    position = key - req * MASK_STRIDE
    cu = cu_num_logits_ptr.long()
    start = cu[req]
    active = (position < cu[req + 1] - start).nonzero().flatten()
    if active.numel() == 0:
        return
    target_rows = start[active] + position[active]
    words_needed = (vocab_size + 31) // 32
    # The kernel masks word loads at bitmask_stride and reads 0 (= disallowed) beyond it.
    packed = _rows(bitmask_ptr, bitmask_stride, min(words_needed, bitmask_stride))[:num_masks]
    if packed.shape[1] < words_needed:
        packed = torch.nn.functional.pad(packed, (0, words_needed - packed.shape[1]))
    # -1 where a token's bit is 0 (banned), else 0: an all-ones / all-zeros select mask per logit.
    ban = ((packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).sub_(1)
    ban = ban.reshape(num_masks, -1)[active, :vocab_size]

    # Several masks may target one logits row: their bans add up (each program stores only -inf).
    target, which = target_rows.unique(return_inverse=True)
    if target.numel() != active.numel():
        ban = torch.zeros(target.numel(), vocab_size, dtype=torch.int32).index_add_(0, which, ban).clamp_(min=-1)
    else:
        ban = ban[which.argsort()]
    logits = _rows(logits_ptr, logits_stride, vocab_size)
    # Branchless select on the raw bits (x ^ ((x ^ -inf) & ban)): exact, and unlike masked_fill / where its cost
    # does not depend on how irregular the grammar's mask is.
    int_t = _INT_OF[logits.dtype]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(int_t)
    rows = logits.index_select(0, target).view(int_t)
    rows ^= (rows ^ neg_inf) & ban.to(int_t)
    logits.index_copy_(0, target, rows.view(logits.dtype))
