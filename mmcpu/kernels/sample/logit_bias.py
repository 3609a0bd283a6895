"""Native ``vllm/v1/worker/gpu/sample/logit_bias.py``: allowed_token_ids, logit_bias and min_tokens' stop-token
masking, in the kernel's order, in place on the logits."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _rows(t: torch.Tensor, stride: int, ncols: int) -> torch.Tensor:
    """``t`` addressed as ``ptr + row * stride + col`` (col < ncols): a writable 2-D view."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
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


@native("vllm.v1.worker.gpu.sample.logit_bias", "_bias_kernel",
        sha256="487f7e3a4bf9952c85c0e6de4c8afe0b2343c9961d73a93e8d1bdbc993c4e852")
def _bias_kernel(grid, logits_ptr, logits_stride, vocab_size, expanded_idx_mapping_ptr, num_allowed_token_ids_ptr,
                 allowed_token_ids_ptr, allowed_token_ids_stride, num_logit_bias_ptr, bias_token_ids_ptr,
                 bias_token_ids_stride, bias_ptr, bias_stride, pos_ptr, min_lens_ptr, num_stop_token_ids_ptr,
                 stop_token_ids_ptr, stop_token_ids_stride, BLOCK_SIZE, LOGITS_BLOCK_SIZE):
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

    # min_tokens: stop tokens are -inf while pos + 1 < min_len.
    n = num_stop_token_ids_ptr[req].long().clamp(max=BLOCK_SIZE)
    on = (n > 0) & (pos_ptr[:num_tokens].long() + 1 < min_lens_ptr[req].long())
    rows = on.nonzero().flatten()
    if rows.numel():
        owner, ids = _entries(stop_token_ids_ptr, stop_token_ids_stride, req[rows], n[rows])
        logits[rows[owner], ids.long()] = neg_inf
