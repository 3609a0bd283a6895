"""Native ``vllm/v1/worker/gpu/sample/batch_shard.py``: ``--enable-batch-sharded-sampling`` (tensor parallelism)
splits the sampler's batch across ranks by request owner (``req_state_idx % TP_SIZE``) and gathers the outputs
back. The kernels plan the split and pack / unpack rows for the all-gathers: index arithmetic and copies, done
program by program over numpy views (a batch of requests, a few rows each)."""

from __future__ import annotations

import numpy as np

from mmcpu.kernels.buffer_utils import flat
from mmcpu.kernels.dispatch import native


def _rem(a: np.ndarray, b: int) -> np.ndarray:
    """Triton's ``%`` on integers: the remainder takes the dividend's sign (C semantics)."""
    return np.fmod(a, b)


@native(
    "vllm.v1.worker.gpu.sample.batch_shard",
    "_build_shard_plan_kernel",
    sha256="6a272249e10acaa49f4887ce053030010d1d366307e921371174850490db08cb",
)
def _build_shard_plan_kernel(
    grid,
    idx_mapping_ptr,
    cu_num_logits_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sorted_logits_indices_ptr,
    gathered_src_indices_ptr,
    local_idx_mapping_ptr,
    local_cu_num_logits_ptr,
    local_logits_indices_ptr,
    local_expanded_idx_mapping_ptr,
    local_expanded_local_pos_ptr,
    local_seq_lens_ptr,
    num_reqs,
    local_logits_start,
    max_num_reqs_per_rank,
    TP_SIZE,
    TP_RANK,
    PADDED_NUM_REQS,
    PADDED_NUM_LOGITS_PER_REQ,
):
    # Request i (owner o = its state index % TP_SIZE) gets its logits rows at an owner-sorted offset (rows of
    # lower owners, then of o's earlier requests); the owner rank also builds its local sub-batch.
    programs = grid[0]
    if programs <= 0:
        return
    idx, cu, qsl = flat(idx_mapping_ptr), flat(cu_num_logits_ptr), flat(query_start_loc_ptr)
    m = max(min(int(num_reqs), PADDED_NUM_REQS), 0)  # the requests each program's sums see
    owners = _rem(idx[:m].astype(np.int64), TP_SIZE)
    counts = cu[1 : m + 1].astype(np.int64) - cu[:m].astype(np.int64)
    sorted_out, src_out = flat(sorted_logits_indices_ptr), flat(gathered_src_indices_ptr)
    for i in range(programs):
        r = int(idx[i])
        owner = int(_rem(np.int64(r), TP_SIZE))
        n = int(cu[i + 1]) - int(cu[i])
        j = np.arange(m)
        earlier = (owners == owner) & (j < i)
        start = int(counts[owners < owner].sum() + counts[earlier].sum())
        k = np.arange(max(min(n, PADDED_NUM_LOGITS_PER_REQ), 0))
        logits_indices = int(qsl[i + 1]) - n + k
        sorted_out[start + k] = logits_indices
        local_req = int(earlier.sum())
        src_out[i] = owner * int(max_num_reqs_per_rank) + local_req
        if i == 0:
            flat(local_cu_num_logits_ptr)[0] = 0
        if owner == TP_RANK:
            local_start = start - int(local_logits_start)
            flat(local_idx_mapping_ptr)[local_req] = r
            flat(local_cu_num_logits_ptr)[local_req + 1] = local_start + n
            flat(local_logits_indices_ptr)[local_start + k] = logits_indices
            flat(local_expanded_idx_mapping_ptr)[local_start + k] = r
            flat(local_expanded_local_pos_ptr)[local_start + k] = k
            flat(local_seq_lens_ptr)[local_req] = flat(seq_lens_ptr)[i]


@native(
    "vllm.v1.worker.gpu.sample.batch_shard",
    "_pack_sampler_output_kernel",
    sha256="596c2a58195b27dd426ac1d3f8d5de4fbc56f476eeaf9f603d084dbb90413c5f",
)
def _pack_sampler_output_kernel(
    grid,
    packed_ptr,
    packed_stride,
    sampled_token_ids_ptr,
    sampled_token_ids_stride,
    num_sampled_ptr,
    num_rejected_ptr,
    num_nans_ptr,
    local_cu_num_logits_ptr,
    max_num_logits_per_req,
    num_src_cols,
    BLOCK_SIZE,
):
    # Local request i's row: its sampled ids (0 past num_src_cols), then num_sampled, num_rejected[, its NaNs].
    n = grid[0]
    if n <= 0:
        return
    packed, sampled = flat(packed_ptr), flat(sampled_token_ids_ptr)
    width = max(min(int(max_num_logits_per_req), BLOCK_SIZE), 0)
    have = max(min(int(num_src_cols), BLOCK_SIZE), 0)
    mx, stride, s_stride = int(max_num_logits_per_req), int(packed_stride), int(sampled_token_ids_stride)
    ns, nr = flat(num_sampled_ptr), flat(num_rejected_ptr)
    for i in range(n):
        row = np.zeros(width, np.int64)
        take = min(have, width)
        row[:take] = sampled[i * s_stride : i * s_stride + take]
        packed[i * stride : i * stride + width] = row
        packed[i * stride + mx] = ns[i]
        packed[i * stride + mx + 1] = nr[i]
        if num_nans_ptr is not None:
            cu = flat(local_cu_num_logits_ptr)
            start = int(cu[i])
            k = max(min(int(cu[i + 1]) - start, BLOCK_SIZE), 0)
            packed[i * stride + mx + 2] = flat(num_nans_ptr)[start : start + k].astype(np.int64).sum()


@native(
    "vllm.v1.worker.gpu.sample.batch_shard",
    "_unpack_gathered_output_kernel",
    sha256="e747177c9e3e8c8db493d14d0d06c537264238858fe6b69940ab86669522a879",
)
def _unpack_gathered_output_kernel(
    grid,
    gathered_ptr,
    gathered_stride,
    gathered_src_indices_ptr,
    sampled_token_ids_ptr,
    num_sampled_ptr,
    num_rejected_ptr,
    num_nans_ptr,
    max_num_logits_per_req,
    BLOCK_SIZE,
):
    # Request i reads gathered row src[i]: its sampled ids, num_sampled, num_rejected[, NaNs] (int64 -> int32).
    n = grid[0]
    if n <= 0:
        return
    g, src = flat(gathered_ptr), flat(gathered_src_indices_ptr)[:n].astype(np.int64)
    mx, stride = int(max_num_logits_per_req), int(gathered_stride)
    width = max(min(mx, BLOCK_SIZE), 0)
    out = flat(sampled_token_ids_ptr)
    base = src * stride
    cols = np.arange(width)
    out[(np.arange(n) * mx)[:, None] + cols] = g[base[:, None] + cols]
    flat(num_sampled_ptr)[:n] = g[base + mx].astype(np.int32)
    flat(num_rejected_ptr)[:n] = g[base + mx + 1].astype(np.int32)
    if num_nans_ptr is not None:
        flat(num_nans_ptr)[:n] = g[base + mx + 2].astype(np.int32)


@native(
    "vllm.v1.worker.gpu.sample.batch_shard",
    "_pack_logprobs_kernel",
    sha256="1620e6d121c5381f0f464dea460ea136ee330bbeaecda5c89a5cb76b54d14de9",
)
def _pack_logprobs_kernel(
    grid,
    send_ids_ptr,
    send_ids_stride,
    send_logprobs_ptr,
    send_logprobs_stride,
    src_ids_ptr,
    src_ids_stride,
    src_logprobs_ptr,
    src_logprobs_stride,
    selected_token_ranks_ptr,
    local_cu_num_logits_ptr,
    max_num_logits_per_req,
    num_logprob_cols,
    num_src_cols,
    BLOCK_SIZE,
):
    # Local logits row start[i] + p goes to send row i * max + p: its ids (0 past num_src_cols) and rank after
    # num_logprob_cols columns; its logprobs (-inf past num_src_cols) in fp32.
    n, positions = grid[0], grid[1]
    if n <= 0 or positions <= 0:
        return
    cu = flat(local_cu_num_logits_ptr)[: n + 1].astype(np.int64)
    counts = np.minimum(cu[1:] - cu[:-1], positions)
    i = np.repeat(np.arange(n), np.maximum(counts, 0))
    if i.size == 0:
        return
    p = np.arange(i.size) - np.repeat(np.cumsum(np.maximum(counts, 0)) - np.maximum(counts, 0), np.maximum(counts, 0))
    src, dst = cu[i] + p, i * int(max_num_logits_per_req) + p
    ncols = max(min(int(num_logprob_cols), BLOCK_SIZE), 0)
    have = max(min(int(num_src_cols), ncols), 0)
    cols = np.arange(ncols)
    ids = np.zeros((i.size, ncols), np.int64)
    lps = np.full((i.size, ncols), -np.inf, np.float32)
    if have:
        ids[:, :have] = flat(src_ids_ptr)[(src * int(src_ids_stride))[:, None] + cols[:have]]
        lps[:, :have] = flat(src_logprobs_ptr)[(src * int(src_logprobs_stride))[:, None] + cols[:have]]
    send_ids = flat(send_ids_ptr)
    send_ids[(dst * int(send_ids_stride))[:, None] + cols] = ids
    send_ids[dst * int(send_ids_stride) + int(num_logprob_cols)] = flat(selected_token_ranks_ptr)[src]
    flat(send_logprobs_ptr)[(dst * int(send_logprobs_stride))[:, None] + cols] = lps


@native(
    "vllm.v1.worker.gpu.sample.batch_shard",
    "_unpack_logprobs_kernel",
    sha256="32a0c3f3fd04beed8bdb0fed647bb96248444aebb3ae9285b7514f0e4b4f8099",
)
def _unpack_logprobs_kernel(
    grid,
    gathered_ids_ptr,
    gathered_ids_stride,
    gathered_logprobs_ptr,
    gathered_logprobs_stride,
    gathered_src_indices_ptr,
    cu_num_logits_ptr,
    logprob_token_ids_ptr,
    logprobs_ptr,
    selected_token_ranks_ptr,
    max_num_logits_per_req,
    num_logprob_cols,
    BLOCK_SIZE,
):
    # Request i's logits row cu[i] + p reads gathered row src[i] * max + p (ids, then the rank; logprobs).
    n, positions = grid[0], grid[1]
    if n <= 0 or positions <= 0:
        return
    cu = flat(cu_num_logits_ptr)[: n + 1].astype(np.int64)
    counts = np.maximum(np.minimum(cu[1:] - cu[:-1], positions), 0)
    i = np.repeat(np.arange(n), counts)
    if i.size == 0:
        return
    p = np.arange(i.size) - np.repeat(np.cumsum(counts) - counts, counts)
    src = flat(gathered_src_indices_ptr)[:n].astype(np.int64)[i] * int(max_num_logits_per_req) + p
    dst = cu[i] + p
    nc = int(num_logprob_cols)
    cols = np.arange(max(min(nc, BLOCK_SIZE), 0))
    g_ids = flat(gathered_ids_ptr)
    row = src * int(gathered_ids_stride)
    flat(logprob_token_ids_ptr)[(dst * nc)[:, None] + cols] = g_ids[row[:, None] + cols]
    flat(selected_token_ranks_ptr)[dst] = g_ids[row + nc]
    flat(logprobs_ptr)[(dst * nc)[:, None] + cols] = flat(gathered_logprobs_ptr)[
        (src * int(gathered_logprobs_stride))[:, None] + cols
    ]
