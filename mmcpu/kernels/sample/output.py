"""Native ``vllm/v1/worker/gpu/sample/output.py``: ``return_sampling_mask``'s compact sampling supports."""

from __future__ import annotations

import numpy as np
import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.sample.output",
    "_compact_sampling_mask_kernel",
    sha256="61e2a3a5f151e3155784cc575122f358f816bacd821079fd6ef1fb35ed7d4e9c",
)
def _compact_sampling_mask_kernel(
    grid,
    logits_ptr,
    logits_row_stride,
    logits_col_stride,
    cu_num_logits_ptr,
    num_sampled_tokens_ptr,
    token_ids_ptr,
    token_ids_row_stride,
    packed_mask_ptr,
    packed_mask_row_stride,
    counts_ptr,
    vocab_size,
    max_num_kept,
    ROWS_PER_REQUEST,
    BLOCK_SIZE,
):
    # Output row o = (request, slot): a slot the request did not sample gets count 0 and nothing else; else its
    # logits row cu_num_logits[request] + slot gives the first max_num_kept finite-logit ids in order, their full
    # count, and the finite set as a little-endian bitmask of ceil(vocab / 8) bytes.
    n = grid[0]
    if n <= 0:
        return
    out = torch.arange(n)
    req, slot = out // ROWS_PER_REQUEST, out % ROWS_PER_REQUEST
    active = slot < num_sampled_tokens_ptr[req].long()
    counts_ptr[:n][~active] = 0
    rows = active.nonzero().flatten()
    if rows.numel() == 0:
        return
    source = cu_num_logits_ptr[req[rows]].long() + slot[rows]
    storage = logits_ptr.untyped_storage().nbytes() // logits_ptr.element_size() - logits_ptr.storage_offset()
    flat = logits_ptr.as_strided((storage,), (1,))
    cols = torch.arange(vocab_size) * int(logits_col_stride)
    keep = flat[source.unsqueeze(1) * int(logits_row_stride) + cols].isfinite()
    count = keep.sum(dim=1, dtype=torch.int32)
    counts_ptr[rows] = count
    pos = keep.cumsum(dim=1) - 1
    put = keep & (pos < max_num_kept)
    r, c = put.nonzero(as_tuple=True)
    if r.numel():
        ids = token_ids_ptr.as_strided(
            (token_ids_ptr.untyped_storage().nbytes() // 4 - token_ids_ptr.storage_offset(),), (1,)
        )
        ids[rows[r] * int(token_ids_row_stride) + pos[r, c]] = c.to(torch.int32)
    nbytes = -(-vocab_size // 8)
    packed = torch.from_numpy(np.packbits(keep.numpy(), axis=1, bitorder="little"))[:, :nbytes]
    masks = packed_mask_ptr.as_strided(
        (packed_mask_ptr.untyped_storage().nbytes() - packed_mask_ptr.storage_offset(),), (1,)
    )
    masks[(rows * int(packed_mask_row_stride)).unsqueeze(1) + torch.arange(nbytes)] = packed
