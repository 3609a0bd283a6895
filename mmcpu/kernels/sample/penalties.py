"""Native ``vllm/v1/worker/gpu/sample/penalties.py``: repetition/frequency/presence penalties and the
prompt-bitmask / output-count statistics they read."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first element to its last one, as the kernel's pointer arithmetic sees them."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=False)) if t.numel() else 0


def _rows(t: torch.Tensor, stride: int, ncols: int) -> torch.Tensor:
    """``t`` addressed as ``ptr + row * stride + col`` (col < ncols): a writable 2-D view."""
    nrows = (_span(t) - ncols) // stride + 1
    return t.as_strided((nrows, ncols), (stride, 1))


def _unpack_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """(n, W) int32 words -> (n, nbits) bool, bit j of word w is token 32 * w + j (as the kernels unpack)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # arithmetic shift is fine: only bit 0 survives the & 1
    return bits.reshape(packed.shape[0], -1)[:, :nbits].bool()


@native(
    "vllm.v1.worker.gpu.sample.penalties",
    "_penalties_kernel",
    sha256="dee31c4f7bfadbb7aa15a4ebc3ccec856518c857b14ccafc228dbf094f810ccf",
)
def _penalties_kernel(
    grid,
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    token_ids_ptr,
    expanded_local_pos_ptr,
    repetition_penalty_ptr,
    frequency_penalty_ptr,
    presence_penalty_ptr,
    prompt_bin_mask_ptr,
    prompt_bin_mask_stride,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    vocab_size,
    BLOCK_SIZE,
):
    num_tokens = grid[0]
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    rep = repetition_penalty_ptr[req]
    freq = frequency_penalty_ptr[req]
    pres = presence_penalty_ptr[req]
    # Rows with no penalty return before loading logits: never touched.
    rows = ((rep != 1.0) | (freq != 0.0) | (pres != 0.0)).nonzero().flatten()
    if rows.numel() == 0:
        return
    req, rep, freq, pres = req[rows], rep[rows, None], freq[rows, None], pres[rows, None]
    logits_2d = _rows(logits_ptr, logits_stride, vocab_size)
    # index_select copies (then upcast, as the kernel's load): the caller's logits are only written at the end.
    logits = logits_2d.index_select(0, rows).float()
    counts = _rows(output_bin_counts_ptr, output_bin_counts_stride, vocab_size).index_select(
        0, req
    )  # kernel: read only
    pos = expanded_local_pos_ptr[rows].long()
    max_pos = int(pos.max())
    if max_pos > 0:
        # Draft tokens of the same request before this row (token_ids[row - pos + 1 .. row]) count as output.
        k = torch.arange(max_pos)
        src = rows[:, None] - pos[:, None] + 1 + k
        valid = k < pos[:, None]
        tok = token_ids_ptr[torch.where(valid, src, 0)].long()
        valid &= (tok >= 0) & (tok < vocab_size)  # the kernel compares against in-vocab columns only
        counts.scatter_add_(1, torch.where(valid, tok, 0), valid.to(counts.dtype))
    seen = counts > 0

    # Full-vocab selects are gathers / products, not torch.where: CPU where on a data-dependent mask is branchy
    # (~15x slower than a gather here).
    if bool((rep != 1.0).any()):
        packed = _rows(prompt_bin_mask_ptr, prompt_bin_mask_stride, (vocab_size + 31) // 32).index_select(0, req)
        hit = _unpack_bits(packed, vocab_size) | seen
        # The kernel's logits *= where(logits > 0, 1 / scale, scale), scale = where(hit, rep, 1.0): the same fp32
        # factors, picked per element from [1.0, rep, 1 / rep] (1 / rep is the same division as 1 / scale).
        table = torch.cat([torch.ones_like(rep), rep, 1.0 / rep], dim=1)
        hit_u8 = hit.to(torch.uint8)
        pick = hit_u8.add_((logits > 0).logical_and_(hit).to(torch.uint8)).long()  # 0: none, 1: rep, 2: 1 / rep
        logits.mul_(table.gather(1, pick))
    # x - (p * n) as two ops (no fused sub with alpha), as in the kernel. Skipped only when every p is +0.0, for
    # which x - 0.0 == x bit for bit (a -0.0 penalty would turn -0.0 logits into +0.0, so it is not skipped).
    if bool((freq != 0.0).any() or freq.signbit().any()):
        logits.sub_(freq * counts.float())
    if bool((pres != 0.0).any() or pres.signbit().any()):
        logits.sub_(pres * seen.float())
    logits_2d.index_copy_(0, rows, logits.to(logits_2d.dtype))


@native(
    "vllm.v1.worker.gpu.sample.penalties",
    "_bincount_kernel",
    sha256="cfb1d5f04fd01d01bb7bb258cb6554d784253934ec51deb8e4013bd3434cd1e4",
)
def _bincount_kernel(
    grid,
    expanded_idx_mapping_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prompt_len_ptr,
    prefill_len_ptr,
    prompt_bin_mask_ptr,
    prompt_bin_mask_stride,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    BLOCK_SIZE,
):
    num_tokens, num_blocks = grid[0], grid[1]
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    prompt_len = prompt_len_ptr[req].long()[:, None]
    prefill_len = prefill_len_ptr[req].long()[:, None]
    # Positions the launched blocks cover, never beyond the longest length any row reads.
    ncols = min(num_blocks * BLOCK_SIZE, int(torch.maximum(prompt_len, prefill_len).max()) if num_tokens else 0)
    if ncols <= 0:
        return
    p = torch.arange(ncols)
    block_start = p // BLOCK_SIZE * BLOCK_SIZE
    # A block runs only if it starts before prefill_len; in it, prompt tokens are p < prompt_len and
    # output tokens prompt_len <= p < prefill_len.
    is_prompt = (p < prompt_len) & (block_start < prefill_len)
    is_output = (p >= prompt_len) & (p < prefill_len)
    tokens = _rows(all_token_ids_ptr, all_token_ids_stride, ncols)[req].long()

    if bool(is_prompt.any()):
        nwords = prompt_bin_mask_ptr.shape[-1]
        nbits = nwords * 32
        # Set bits as a (row, token) bool table, then pack to int32 words and OR them in (atomic_or).
        seen = torch.zeros(num_tokens, nbits + 1, dtype=torch.bool)
        seen.scatter_(1, torch.where(is_prompt, tokens, nbits), True)
        bits = seen[:, :nbits].view(num_tokens, nwords, 32).long() << torch.arange(32)
        words = bits.sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        mask_2d = _rows(prompt_bin_mask_ptr, prompt_bin_mask_stride, nwords)
        # A request listed twice sets the same bits both times, so plain assignment equals atomic_or.
        mask_2d[req] = mask_2d[req] | words

    if bool(is_output.any()):
        r, c = is_output.nonzero(as_tuple=True)
        counts_2d = _rows(output_bin_counts_ptr, output_bin_counts_stride, output_bin_counts_ptr.shape[-1])
        counts_2d.index_put_((req[r], tokens[r, c]), torch.ones_like(r, dtype=counts_2d.dtype), accumulate=True)
