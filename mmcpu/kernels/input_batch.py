"""Native ``vllm/v1/worker/gpu/input_batch.py``: the per-step input preparation and post-sampling bookkeeping.

One Triton program per request becomes one vectorised numpy pass over all requests (zero-copy views of the
launcher's tensors, see :mod:`mmcpu.kernels.buffer_utils`). Values keep the kernels' dtypes (int32 arithmetic
where the kernel does int32 arithmetic); stores cast to the destination's dtype, as ``tl.store`` does.
"""

from __future__ import annotations

import numpy as np

from mmcpu.kernels.buffer_utils import flat, segments
from mmcpu.kernels.dispatch import native


def _i64(t, n: int) -> np.ndarray:
    return flat(t)[:n].astype(np.int64)


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_prepare_prefill_inputs_kernel",
    sha256="96d1b0d0dffd63d4c564addcfecb5ada2d7835edad2256c31258f8db1d3d6509",
)
def _prepare_prefill_inputs_kernel(
    grid,
    input_ids_ptr,
    next_prefill_tokens_ptr,
    next_prefill_tokens_stride,
    num_lookahead,
    idx_mapping_ptr,
    query_start_loc_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    prefill_lens_ptr,
    num_computed_tokens_ptr,
    BLOCK_SIZE,
    LOOKAHEAD_BLOCK,
):
    # Requests still in prefill copy their next query_len prompt tokens into input_ids, and keep the
    # num_lookahead tokens after them (the next chunk's first ones; 0 past the prompt's end) in
    # next_prefill_tokens[l, req].
    n = grid[0]
    req = _i64(idx_mapping_ptr, n)
    prefill_len = flat(prefill_lens_ptr)[req].astype(np.int64)
    computed = flat(num_computed_tokens_ptr)[req].astype(np.int64)
    qsl = _i64(query_start_loc_ptr, n + 1)
    query_len = qsl[1:] - qsl[:-1]
    prefilling = computed < prefill_len
    if not prefilling.any():
        return
    tokens = flat(all_token_ids_ptr)
    row = req * int(all_token_ids_stride) + computed
    lens = np.where(prefilling, np.maximum(query_len, 0), 0)
    seg, within = segments(lens)
    flat(input_ids_ptr)[qsl[:-1][seg] + within] = tokens[row[seg] + within]
    ahead = int(min(max(int(num_lookahead), 0), LOOKAHEAD_BLOCK))
    if ahead == 0:
        return
    b = np.flatnonzero(prefilling)
    look = np.arange(ahead, dtype=np.int64)
    pos = (computed[b] + query_len[b])[:, None] + look  # [prefilling requests, lookahead]
    inside = pos < prefill_len[b][:, None]
    src = row[b][:, None] - computed[b][:, None] + pos
    values = np.zeros(pos.shape, tokens.dtype)
    values[inside] = tokens[src[inside]]
    flat(next_prefill_tokens_ptr)[look * int(next_prefill_tokens_stride) + req[b][:, None]] = values


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_prepare_pos_seq_lens_kernel",
    sha256="33c07567a9fe63e1744b02482a33d24fcf9a80983cbf3797a33410ef7192487a",
)
def _prepare_pos_seq_lens_kernel(
    grid, pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, max_num_reqs, BLOCK_SIZE
):
    # Program b < num_reqs: seq_lens[b] = computed + query_len, positions computed + [0, query_len).
    # The extra last program (the grid is num_reqs + 1) zeroes seq_lens[num_reqs:max_num_reqs].
    n = grid[0] - 1
    req = _i64(idx_mapping_ptr, n)
    computed = flat(num_computed_tokens_ptr)[req]  # int32, as the kernel adds
    qsl = flat(query_start_loc_ptr)[: n + 1]
    query_len = qsl[1:] - qsl[:-1]
    seq_lens = flat(seq_lens_ptr)
    seq_lens[:n] = computed + query_len
    seg, within = segments(np.maximum(query_len, 0).astype(np.int64))
    flat(pos_ptr)[qsl[:-1][seg].astype(np.int64) + within] = computed[seg] + within.astype(np.int32)
    if n < max_num_reqs:
        seq_lens[n:max_num_reqs] = 0


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_combine_sampled_and_draft_tokens_kernel",
    sha256="c02435e0be07b2faaf3470fdc5bb3da56fe3feeb84a6754edabeb8a4a9c9ffb5",
)
def _combine_sampled_and_draft_tokens_kernel(
    grid,
    input_ids_ptr,
    idx_mapping_ptr,
    last_sampled_tokens_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    prefill_len_ptr,
    draft_tokens_ptr,
    draft_tokens_stride,
    cu_num_logits_ptr,
    logits_indices_ptr,
    BLOCK_SIZE,
    NUM_NEW_SAMPLED_TOKENS=1,
):
    # Per request: its logits are the last num_logits query tokens (logits_indices, at most BLOCK_SIZE of
    # them); a decoding request's input_ids take the last sampled token, then its draft tokens.
    n = grid[0]
    req = _i64(idx_mapping_ptr, n)
    cu = _i64(cu_num_logits_ptr, n + 1)
    num_logits = cu[1:] - cu[:-1]
    query_end = _i64(query_start_loc_ptr, n + 1)[1:]
    logits_start = query_end - num_logits
    seg, within = segments(np.clip(num_logits, 0, BLOCK_SIZE))
    flat(logits_indices_ptr)[cu[:-1][seg] + within] = logits_start[seg] + within

    seq_len = _i64(seq_lens_ptr, n)
    prefill_len = flat(prefill_len_ptr)[req].astype(np.int64)
    decoding = seq_len > prefill_len  # requests still in prefill have no sampled or draft tokens
    if not decoding.any():
        return
    input_ids = flat(input_ids_ptr)
    if NUM_NEW_SAMPLED_TOKENS > 0:
        # Only when the first logit is past the prompt: a prompt-tail slot keeps its prompt token.
        last = decoding & (seq_len - num_logits >= prefill_len)
        input_ids[logits_start[last]] = flat(last_sampled_tokens_ptr)[req[last]]
    num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
    seg, within = segments(np.where(decoding, np.clip(num_draft, 0, BLOCK_SIZE), 0))
    if seg.size:
        drafts = flat(draft_tokens_ptr)[req[seg] * int(draft_tokens_stride) + within]
        input_ids[(query_end - num_draft)[seg] + within] = drafts


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_get_num_sampled_and_rejected_kernel",
    sha256="17bfac5e1599de85b571ef87ebf3f903ff0059666bc126ec69a0fb0a93ce3880",
)
def _get_num_sampled_and_rejected_kernel(
    grid, num_sampled_ptr, num_rejected_ptr, seq_lens_ptr, cu_num_logits_ptr, idx_mapping_ptr, prefill_len_ptr
):
    # Chunked-prefill requests (seq_len < prefill_len) sample and reject nothing; others reject the logits
    # they did not sample. Both outputs written for every request.
    n = grid[0]
    req = _i64(idx_mapping_ptr, n)
    chunked = flat(seq_lens_ptr)[:n] < flat(prefill_len_ptr)[req]
    num_sampled = flat(num_sampled_ptr)
    sampled = np.where(chunked, 0, num_sampled[:n]).astype(num_sampled.dtype)
    cu = flat(cu_num_logits_ptr)[: n + 1]
    rejected = np.where(chunked, 0, (cu[1:] - cu[:-1]) - sampled)
    num_sampled[:n] = sampled
    flat(num_rejected_ptr)[:n] = rejected


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_post_update_kernel",
    sha256="1f8738a0c9e9928a4759df1b42a864d353daf89966051cc8abd96742fc99d4ec",
)
def _post_update_kernel(
    grid,
    idx_mapping_ptr,
    num_computed_tokens_ptr,
    last_sampled_tokens_ptr,
    output_bin_counts_ptr,
    output_bin_counts_stride,
    sampled_tokens_ptr,
    sampled_tokens_stride,
    num_sampled_ptr,
    num_rejected_ptr,
    query_start_loc_ptr,
    all_token_ids_ptr,
    all_token_ids_stride,
    total_len_ptr,
):
    # Per request (idx < 0: skipped): append its num_sampled tokens to all_token_ids at total_len, count them
    # in output_bin_counts, remember the last one, grow total_len; then advance num_computed_tokens by
    # query_len - num_rejected.
    n = grid[0]
    idx = _i64(idx_mapping_ptr, n)
    batch = np.flatnonzero(idx >= 0)
    if batch.size == 0:
        return
    req = idx[batch]
    total_len = flat(total_len_ptr)
    old_len = total_len[req].astype(np.int64)  # read before any program writes it
    num_sampled = flat(num_sampled_ptr)[batch]
    sampled = flat(sampled_tokens_ptr)
    row = batch * int(sampled_tokens_stride)

    has = num_sampled > 0
    if has.any():
        flat(last_sampled_tokens_ptr)[req[has]] = sampled[row[has] + num_sampled[has] - 1]
        total_len[req[has]] = total_len[req[has]] + num_sampled[has]
        seg, within = segments(np.maximum(num_sampled, 0).astype(np.int64))
        tokens = sampled[row[seg] + within]
        flat(all_token_ids_ptr)[req[seg] * int(all_token_ids_stride) + old_len[seg] + within] = tokens
        if output_bin_counts_ptr is not None:
            # add.at: a token sampled twice (speculative decoding) counts twice, like the kernel's loop.
            bins = flat(output_bin_counts_ptr)
            np.add.at(bins, req[seg] * int(output_bin_counts_stride) + tokens.astype(np.int64), np.ones(1, bins.dtype))

    if query_start_loc_ptr is None:
        query_len = np.zeros(batch.size, np.int32)
    else:
        qsl = flat(query_start_loc_ptr)
        query_len = qsl[batch + 1] - qsl[batch]
    delta = query_len - flat(num_rejected_ptr)[batch]
    moved = delta != 0
    if moved.any():
        np.add.at(flat(num_computed_tokens_ptr), req[moved], delta[moved])


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_post_update_num_computed_tokens_kernel",
    sha256="b268224427020033c4014e6b4264131bd7f65e57dfffb392ec5f1a5a1bb134f9",
)
def _post_update_num_computed_tokens_kernel(grid, idx_mapping_ptr, num_computed_tokens_ptr, query_start_loc_ptr):
    # num_computed_tokens[idx[b]] += query_len[b]; add.at keeps the kernel's sequential sum for repeated idx.
    n = grid[0]
    qsl = flat(query_start_loc_ptr)[: n + 1]
    np.add.at(flat(num_computed_tokens_ptr), _i64(idx_mapping_ptr, n), qsl[1:] - qsl[:-1])


@native(
    "vllm.v1.worker.gpu.input_batch",
    "_expand_idx_mapping_kernel",
    sha256="7636f8d252d474bfcf2063d5d0909093055e6e73fffc3d910ac30c4d138caff4",
)
def _expand_idx_mapping_kernel(
    grid, idx_mapping_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr, cu_num_logits_ptr, BLOCK_SIZE
):
    # Request b's logits [cu[b], cu[b+1]) (at most BLOCK_SIZE) get its state index and their local position.
    n = grid[0]
    cu = _i64(cu_num_logits_ptr, n + 1)
    seg, within = segments(np.clip(cu[1:] - cu[:-1], 0, BLOCK_SIZE))
    dst = cu[:-1][seg] + within
    flat(expanded_idx_mapping_ptr)[dst] = flat(idx_mapping_ptr)[:n][seg]
    flat(expanded_local_pos_ptr)[dst] = within
