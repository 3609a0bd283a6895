"""Native ``vllm/v1/worker/gpu/sample/bad_words.py``: a bad word's last token becomes -inf when the tokens
before it (output tokens, then this step's draft tokens, which follow the last committed one in input_ids) end
with the word's prefix."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the flat memory its pointer addresses (index = element offset), writable."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=False))
    return t.as_strided((span,), (1,))


@native(
    "vllm.v1.worker.gpu.sample.bad_words",
    "_bad_words_kernel",
    sha256="d615f1d7c7e1715c892f4ce9c67e792f1ec9b6bc03c59669d7a4bda710086d9c",
)
def _bad_words_kernel(
    grid,
    logits_ptr,
    logits_stride,
    expanded_idx_mapping_ptr,
    bad_word_token_ids_ptr,
    bad_word_token_ids_stride,
    bad_word_offsets_ptr,
    bad_word_offsets_stride,
    num_bad_words_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prompt_len_ptr,
    total_len_ptr,
    input_ids_ptr,
    expanded_local_pos_ptr,
):
    # Program (t, w) = token row t, bad word w; all of them at once as (T, W[, prefix]) tensors.
    num_tokens, max_words = grid[0], grid[1]
    token = torch.arange(num_tokens)
    req = expanded_idx_mapping_ptr[:num_tokens].long()
    w = torch.arange(max_words)
    live = w < num_bad_words_ptr[req].long()[:, None]
    if not bool(live.any()):
        return
    pos = expanded_local_pos_ptr[:num_tokens].long()
    first = token - pos  # this request's first row in input_ids
    prompt_len = prompt_len_ptr[req].long()
    output_len = total_len_ptr[req].long() - prompt_len
    effective_len = (output_len + pos)[:, None]  # tokens before this row's sampled one, drafts included

    offsets = _flat(bad_word_offsets_ptr)
    off_at = torch.where(live, req[:, None] * bad_word_offsets_stride + w, 0)
    start = torch.where(live, offsets[off_at].long(), 0)
    end = torch.where(live, offsets[off_at + 1].long(), 0)
    prefix_len = end - start - 1
    live &= prefix_len <= effective_len
    if not bool(live.any()):
        return

    words = _flat(bad_word_token_ids_ptr)
    word_base = req[:, None] * bad_word_token_ids_stride
    match = live.clone()
    longest = int(prefix_len[live].max())
    if longest > 0:
        i = torch.arange(longest)
        used = live[..., None] & (i < prefix_len[..., None])  # (T, W, longest)
        expected = words[torch.where(used, (word_base + start)[..., None] + i, 0)]
        actual_pos = (effective_len - prefix_len)[..., None] + i
        from_spec = actual_pos >= output_len[:, None, None]
        # input_ids at a request's local position 0 is its last committed token; drafts start at 1.
        spec_at = first[:, None, None] + actual_pos - output_len[:, None, None] + 1
        out_at = (req * all_token_ids_stride + prompt_len)[:, None, None] + actual_pos
        actual = torch.where(
            from_spec,
            input_ids_ptr[torch.where(used & from_spec, spec_at, 0)].long(),
            _flat(all_token_ids_ptr)[torch.where(used & ~from_spec, out_at, 0)].long(),
        )
        match &= ((expected.long() == actual) | ~used).all(dim=-1)

    t, wi = match.nonzero(as_tuple=True)
    if t.numel() == 0:
        return
    last_at = word_base[t, 0] + end[t, wi] - 1
    keep = last_at >= 0  # an empty first word would read before the table (undefined in the kernel): skip it
    t, last = t[keep], words[last_at[keep]].long()
    _flat(logits_ptr)[t * logits_stride + last] = float("-inf")
