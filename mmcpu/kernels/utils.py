"""Native ``vllm/v1/worker/utils.py``: ``KVBlockZeroer``'s kernel (zeroes fresh KV blocks of hybrid models)."""

from __future__ import annotations

import torch

from mmcpu.kernels import ptr
from mmcpu.kernels.dispatch import native


@native("vllm.v1.worker.utils", "_zero_kv_blocks_kernel",
        sha256="296aa0f0bebe644150cdaaa5276c8d20c12b974d13f925e8735dbe95ab1f5937")
def _zero_kv_blocks_kernel(grid, seg_addrs_ptr, block_ids_ptr, n_blocks, N_SEGS, PAGE_SIZE_EL, BLOCK_SIZE):
    # Program pid zeroes chunk (pid % chunks) of segment (pid // chunks % N_SEGS) of block (pid // work):
    # BLOCK_SIZE int32 words at seg_addr + (block_id * PAGE_SIZE_EL + chunk * BLOCK_SIZE) * 4.
    chunks = PAGE_SIZE_EL // BLOCK_SIZE
    work = N_SEGS * chunks
    if work <= 0:
        return
    programs = grid[0]
    full = min(n_blocks, programs // work)  # blocks whose every program is in the grid
    # A grid that is not a whole number of blocks (the launcher never makes one) covers a prefix of the next.
    rest = programs - full * work if full < n_blocks else 0
    num_ids = full + (1 if rest > 0 else 0)
    if num_ids == 0:
        return
    ids = block_ids_ptr[:num_ids].long()
    addrs = seg_addrs_ptr[:N_SEGS].view(torch.int64).tolist()  # user-space addresses fit in int64
    span = chunks * BLOCK_SIZE  # words of a page the kernel touches (all of it when BLOCK_SIZE divides it)
    numel = (int(ids.max()) + 1) * PAGE_SIZE_EL
    for seg, addr in enumerate(addrs):
        pages = ptr.view(addr, torch.int32, numel).view(-1, PAGE_SIZE_EL)
        if full:
            if span == PAGE_SIZE_EL:
                pages.index_fill_(0, ids[:full], 0)  # whole pages: one fill, no index_put
            else:
                pages[ids[:full], :span] = 0
        if rest:
            done = min(max(rest - seg * chunks, 0), chunks)  # chunks of this segment the partial block reaches
            if done:
                pages[ids[full], : done * BLOCK_SIZE] = 0
