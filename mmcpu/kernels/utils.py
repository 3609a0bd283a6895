"""Native ``vllm/v1/worker/utils.py``: ``KVBlockZeroer``'s kernel (zeroes fresh KV blocks of hybrid models)."""

from __future__ import annotations

import torch

from mmcpu.kernels import ptr
from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.utils",
    "_zero_kv_blocks_kernel",
    sha256="c62acf83e325156b64208c54a496e3ce88196216822397e41c1dbaa9fa527770",
)
def _zero_kv_blocks_kernel(grid, seg_addrs_ptr, seg_block_strides_ptr, seg_page_sizes_ptr, block_ids_ptr, BLOCK_SIZE):
    # Program (b, s, c) zeroes int32 words [c * BLOCK_SIZE, (c + 1) * BLOCK_SIZE) below page_size[s] at
    # seg_addr[s] + block_id[b] * block_stride[s] words; so per segment, the first min(page_size[s],
    # chunks * BLOCK_SIZE) words of each block.
    num_ids, num_segs, chunks = grid[0], grid[1], grid[2] if len(grid) > 2 else 1
    if num_ids <= 0 or num_segs <= 0 or chunks <= 0:
        return
    ids = block_ids_ptr[:num_ids].long()
    max_id = int(ids.max())
    addrs = seg_addrs_ptr[:num_segs].view(torch.int64).tolist()  # user-space addresses fit in int64
    strides = seg_block_strides_ptr[:num_segs].tolist()
    pages = seg_page_sizes_ptr[:num_segs].tolist()
    for addr, stride, page in zip(addrs, strides, pages, strict=False):
        span = min(int(page), chunks * BLOCK_SIZE)
        if span <= 0:
            continue
        stride = int(stride)
        memory = ptr.view(addr, torch.int32, max_id * stride + span)
        if stride == span:
            memory.view(-1, span).index_fill_(0, ids, 0)  # whole blocks back to back: one fill
        else:
            memory.as_strided((max_id + 1, span), (stride, 1)).index_fill_(0, ids, 0)
