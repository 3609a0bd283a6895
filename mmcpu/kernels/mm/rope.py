"""Native ``vllm/v1/worker/gpu/mm/rope.py``: M-RoPE / XD-RoPE positions (Qwen2-VL-style models)."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.mm.rope",
    "_prepare_rope_positions_kernel",
    sha256="3c71f6bcc409d834ba22eb93cc29259d55f5e4026b668b0e4137f7f9e436ee32",
)
def _prepare_rope_positions_kernel(
    grid,
    positions_ptr,
    positions_stride,
    prefill_positions_ptr,
    prefill_positions_stride0,
    prefill_positions_stride1,
    prefill_delta_ptr,
    idx_mapping_ptr,
    query_start_loc_ptr,
    prefill_lens_ptr,
    num_computed_tokens_ptr,
    BLOCK_SIZE,
    NUM_DIMS,
):
    # One program per request: for each of its query tokens and each rope dim, write either the staged
    # prefill position (request still in prefill) or orig_pos + delta (decode). BLOCK_SIZE only tiles the loop.
    num_reqs = grid[0]
    if num_reqs <= 0:
        return
    req = idx_mapping_ptr[:num_reqs].long()
    num_computed = num_computed_tokens_ptr[req]
    is_prefill = num_computed < prefill_lens_ptr[req]
    delta = prefill_delta_ptr[req]
    qsl = query_start_loc_ptr[: num_reqs + 1]
    query_start = qsl[:-1]
    query_len = (qsl[1:] - query_start).clamp_min(0).long()  # a negative length runs no loop iteration
    total = int(query_len.sum())
    if total == 0:
        return

    # Flatten (request, token-in-query) pairs; `block` is Triton's int32 arange offset within the query.
    tok_req = torch.repeat_interleave(torch.arange(num_reqs), query_len)
    first = torch.cumsum(query_len, 0) - query_len
    block = (torch.arange(total) - first[tok_req]).to(torch.int32)
    orig_pos = num_computed[tok_req] + block  # keeps the kernel's integer width (int32 + int32 stays int32)
    dest = query_start[tok_req].long() + block.long()

    dims = torch.arange(NUM_DIMS)
    # Decode values everywhere, then overwrite prefill tokens with their staged positions; prefill memory is only
    # read at the tokens that are in prefill, as in the kernel.
    pos = (orig_pos + delta[tok_req]).to(positions_ptr.dtype).unsqueeze(0).expand(NUM_DIMS, total).clone()
    pre = is_prefill[tok_req].nonzero().flatten()
    if pre.numel():
        src = (
            (req[tok_req[pre]] * prefill_positions_stride0).unsqueeze(0)
            + (dims * prefill_positions_stride1).unsqueeze(1)
            + orig_pos[pre].long().unsqueeze(0)
        )
        table = prefill_positions_ptr.as_strided((int(src.max()) + 1,), (1,))
        pos[:, pre] = table[src].to(pos.dtype)  # the store's cast, as tl.store into the int64 buffer

    out_idx = (dims * positions_stride).unsqueeze(1) + dest.unsqueeze(0)
    out = positions_ptr.as_strided((int(out_idx.max()) + 1,), (1,))
    out[out_idx.flatten()] = pos.flatten()
