"""Native ``vllm/v1/worker/gpu/sample/logit_bias.py``: allowed_token_ids, logit_bias and min_tokens' stop-token
masking, in the kernel's order, in place on the logits."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _rows(t: torch.Tensor, stride: int, ncols: int) -> torch.Tensor:
    """``t`` addressed as ``ptr + row * stride + col`` (col < ncols): a writable 2-D view."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=False))
    return t.as_strided(((span - ncols) // stride + 1, ncols), (stride, 1))


def _lists(count_ptr: torch.Tensor, req: torch.Tensor, limit: int):
    """Rows whose per-request count is > 0, and the counts (capped at the kernel's block: it masks beyond)."""
    n = count_ptr[req].long().clamp(max=limit)
    rows = (n > 0).nonzero().flatten()
    return rows, n[rows]


def _entries(base: torch.Tensor, stride: int, req: torch.Tensor, n: torch.Tensor):
    """The first ``n[i]`` entries of row ``req[i]`` of ``base``, flattened, with the owning i."""
    k = int(n.max())
    table = _rows(base, stride, k)[req]
    valid = torch.arange(k) < n[:, None]
    owner = valid.nonzero(as_tuple=True)[0]
    return owner, table[valid]


def _all_masked(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Per row of ``rows`` (fp32): whether the kernel's row scan ends at -inf. It takes ``tl.max`` per
    ``block``-wide chunk (masked tail = -inf) and folds the chunks with ``tl.maximum``: in Triton's interpreter
    (and ``MMCPU_KERNELS=interpreter``) a chunk's max skips NaNs (``np.nanmax``) unless the chunk is all NaN,
    while the fold propagates one; so a row is all-masked iff every non-NaN value is -inf and no chunk is all NaN."""
    n, cols = rows.shape
    chunks = -(-cols // block)
    padded = torch.full((n, chunks * block), float("-inf"), dtype=torch.float32)
    padded[:, :cols] = rows
    nan = padded.isnan()
    masked = ((padded == float("-inf")) | nan).all(dim=1)
    return masked & ~nan.view(n, chunks, block).all(dim=2).any(dim=1)


@native(
    "vllm.v1.worker.gpu.sample.logit_bias",
    "_bias_kernel",
    sha256="d8897887756bb45c5ebd5a9f58742d1573da3437b1a3b72d403d9cdf5e4c4fff",
)
def _bias_kernel(
    grid,
    logits_ptr,
    logits_stride,
    vocab_size,
    expanded_idx_mapping_ptr,
    num_allowed_token_ids_ptr,
    allowed_token_ids_ptr,
    allowed_token_ids_stride,
    num_logit_bias_ptr,
    bias_token_ids_ptr,
    bias_token_ids_stride,
    bias_ptr,
    bias_stride,
    pos_ptr,
    min_lens_ptr,
    num_stop_token_ids_ptr,
    restore_when_all_masked_ptr,
    stop_token_ids_ptr,
    stop_token_ids_stride,
    BLOCK_SIZE,
    LOGITS_BLOCK_SIZE,
    CHECK_ALL_MASKED_ROWS,
):
    num_tokens = grid[0]
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    logits = _rows(logits_ptr, logits_stride, vocab_size)
    neg_inf = float("-inf")

    # Allowed token ids: keep their logits, everything else in the row becomes -inf.
    rows, n = _lists(num_allowed_token_ids_ptr, req, BLOCK_SIZE)
    if rows.numel():
        owner, ids = _entries(allowed_token_ids_ptr, allowed_token_ids_stride, req[rows], n)
        at = (rows[owner], ids.long())
        saved = logits[at]  # advanced indexing copies: read before the overwrite, as the kernel does
        logits.index_fill_(0, rows, neg_inf)
        logits[at] = saved

    # Logit bias, added in fp32 and stored back in the logits' dtype.
    rows, n = _lists(num_logit_bias_ptr, req, BLOCK_SIZE)
    if rows.numel():
        owner, ids = _entries(bias_token_ids_ptr, bias_token_ids_stride, req[rows], n)
        _, bias = _entries(bias_ptr, bias_stride, req[rows], n)
        at = (rows[owner], ids.long())
        logits[at] = (logits[at].float() + bias).to(logits.dtype)

    # min_tokens: stop tokens are -inf while pos + 1 < min_len. With CHECK_ALL_MASKED_ROWS, a request flagged
    # restore_when_all_masked (structured output) gets its finite stop logits back when that leaves its row
    # all -inf (its grammar allows nothing but stopping).
    n = num_stop_token_ids_ptr[req].long().clamp(max=BLOCK_SIZE)
    on = (n > 0) & (pos_ptr[:num_tokens].long() + 1 < min_lens_ptr[req].long())
    rows = on.nonzero().flatten()
    if rows.numel():
        owner, ids = _entries(stop_token_ids_ptr, stop_token_ids_stride, req[rows], n[rows])
        at = (rows[owner], ids.long())
        saved = logits[at] if CHECK_ALL_MASKED_ROWS else None
        logits[at] = neg_inf
        if CHECK_ALL_MASKED_ROWS:
            restore = restore_when_all_masked_ptr[req[rows]] != 0
            if bool(restore.any()):
                check = rows[restore]
                back = torch.zeros(num_tokens, dtype=torch.bool)
                back[check] = _all_masked(logits[check].float(), LOGITS_BLOCK_SIZE)
                put = back[at[0]] & saved.isfinite()
                logits[at[0][put], at[1][put]] = saved[put]
