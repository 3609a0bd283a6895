"""Native ``vllm/v1/worker/gpu/block_table.py``: gather per-batch block tables and compute slot mappings.

Block tables are reached through tables of raw int32 pointers (one per KV-cache group); each is viewed over
exactly the elements the kernel can address. See :mod:`mmcpu.kernels.buffer_utils` for the numpy views.
"""

from __future__ import annotations

import numpy as np
import torch

from mmcpu.kernels.buffer_utils import flat, segments, tdiv
from mmcpu.kernels.dispatch import native
from mmcpu.kernels.ptr import array as table


@native(
    "vllm.v1.worker.gpu.block_table",
    "_gather_block_tables_kernel",
    sha256="fdab24bafcf37be5a9febf288e24efdac9a5abf18f992b76508bc7b52eddac94",
)
def _gather_block_tables_kernel(
    grid,
    batch_idx_to_req_idx,
    src_block_table_ptrs,
    dst_block_table_ptrs,
    block_table_strides,
    num_blocks_ptr,
    num_blocks_stride,
    num_reqs,
    BLOCK_SIZE,
):
    # Program (g, b): dst_g[b, :num_blocks[g, req]] = src_g[req, :num_blocks[g, req]] for req = idx[b];
    # rows b >= num_reqs of the padded grid are zeroed over the whole row (stride = max_num_blocks).
    num_groups, num_padded = grid[0], grid[1]
    n = max(0, min(int(num_reqs), num_padded))
    req = flat(batch_idx_to_req_idx)[:n].astype(np.int64)
    src_addrs, dst_addrs = flat(src_block_table_ptrs), flat(dst_block_table_ptrs)
    strides = flat(block_table_strides)
    num_blocks = flat(num_blocks_ptr)
    for g in range(num_groups):
        stride = int(strides[g])
        lens = np.maximum(num_blocks[g * num_blocks_stride + req].astype(np.int64), 0)
        dst_end = max(num_padded * stride, int((np.arange(n) * stride + lens).max(initial=0)))
        if dst_end == 0:
            continue
        dst = table(dst_addrs[g], torch.int32, dst_end)
        if lens.any():
            src_start = req * stride
            src = table(src_addrs[g], torch.int32, int((src_start + lens).max()))
            seg, within = segments(lens)
            dst[seg * stride + within] = src[src_start[seg] + within]
        # Padded programs run after the real ones (higher program id), so their zeros win any overlap.
        dst[n * stride : num_padded * stride] = 0


@native(
    "vllm.v1.worker.gpu.block_table",
    "_compute_slot_mappings_kernel",
    sha256="71e2f8ce757c54aa44508718efa7cb2a08ec81d2b8dfba46f26af7c66de10d74",
)
def _compute_slot_mappings_kernel(
    grid,
    max_num_tokens,
    idx_mapping,
    query_start_loc,
    pos,
    block_table_ptrs,
    block_table_strides,
    block_sizes,
    slot_mapping_enabled,
    dcp_sharded,
    slot_mappings_ptr,
    slot_mappings_stride,
    cp_rank,
    CP_SIZE,
    CP_INTERLEAVE,
    PAD_ID,
    TRITON_BLOCK_SIZE,
):
    # Program (g, b < num_reqs): slot of each token in [qsl[b], qsl[b+1]) from its position and req's block
    # table; PAD_ID for a dummy request (idx_mapping < 0), a group without slot mapping, or (context
    # parallelism) a token another rank holds. The last program (b == num_reqs) pads
    # slot_mappings[g, qsl[num_reqs]:max_num_tokens] with PAD_ID.
    num_groups, n = grid[0], grid[1] - 1
    qsl = flat(query_start_loc)[: n + 1].astype(np.int64)
    starts = qsl[:n]
    lens = np.maximum(qsl[1:] - starts, 0)
    seg, within = segments(lens)
    offs = starts[seg] + within
    positions = flat(pos)[offs]
    req = flat(idx_mapping)[:n].astype(np.int64)[seg]
    real = req >= 0
    strides, sizes, addrs = flat(block_table_strides), flat(block_sizes), flat(block_table_ptrs)
    enabled, sharded_groups = flat(slot_mapping_enabled), flat(dcp_sharded)
    out = flat(slot_mappings_ptr)
    pad_from = int(qsl[n])
    for g in range(num_groups):
        row = g * int(slot_mappings_stride)
        if offs.size:
            block_size = sizes[g]  # a numpy int32 scalar: the kernel's int32 products below stay int32
            if CP_SIZE == 1 or not bool(sharded_groups[g]):
                local, is_local = positions, np.ones(positions.shape, bool)
            else:
                # Context parallelism on a sharded group: a token is local if its interleave chunk of the
                # virtual block (the CP_SIZE ranks' blocks side by side) falls on this rank.
                span = block_size * np.int32(CP_SIZE)
                v_off = np.fmod(positions, span)
                is_local = np.fmod(tdiv(v_off, CP_INTERLEAVE), CP_SIZE) == cp_rank
                local = (
                    tdiv(positions, span) * block_size
                    + tdiv(v_off, CP_INTERLEAVE * CP_SIZE) * CP_INTERLEAVE
                    + np.fmod(v_off, CP_INTERLEAVE)
                )
            block_off = np.fmod(local, block_size)
            if bool(enabled[g]):
                load = is_local & real
                numbers = np.zeros(positions.shape, np.int32)
                if load.any():
                    block_idx = req[load] * int(strides[g]) + tdiv(local[load], block_size)
                    numbers[load] = table(addrs[g], torch.int32, int(block_idx.max()) + 1)[block_idx]
                slots = numbers * block_size + block_off
                out[row + offs] = np.where(load, slots, PAD_ID)  # not local or not real: PAD_ID either way
            else:
                out[row + offs] = PAD_ID
        # The padding program has the highest program id of its group: it runs after the real ones.
        if pad_from < max_num_tokens:
            out[row + max(pad_from, 0) : row + max_num_tokens] = PAD_ID
