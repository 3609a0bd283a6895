"""Native ``vllm/v1/worker/gpu/model_states/prompt_embeds.py``: ``--enable-prompt-embeds`` overlays a request's
prompt embeddings (reached through raw pointers) onto the step's ``inputs_embeds``."""

from __future__ import annotations

import torch

from mmcpu.kernels import ptr
from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.model_states.prompt_embeds",
    "_apply_prompt_embeds_kernel",
    sha256="e72cd08343159f4313d0f109a7ca05832ba870588588c616285a24e580b8cfbd",
)
def _apply_prompt_embeds_kernel(
    grid,
    inputs_embeds_ptr,
    inputs_embeds_stride,
    embeds_ptrs_ptr,
    mask_ptrs_ptr,
    embeds_lens_ptr,
    idx_mapping_ptr,
    query_start_loc_ptr,
    num_computed_tokens_ptr,
    hidden_size,
    TOKEN_BLOCK,
    BLOCK_SIZE,
):
    # Batch row b of request r still in its embeds (computed < len): its first min(query_len, len - computed)
    # tokens (as far as the grid's token blocks reach) take rows computed + t of r's embeds, except the rows its
    # is-token-ids mask (int8, pointer 0 = none) flags.
    num_reqs, token_blocks = grid[0], grid[1]
    if num_reqs <= 0 or token_blocks <= 0:
        return
    dtype = inputs_embeds_ptr.dtype
    dst = inputs_embeds_ptr.as_strided(
        (
            inputs_embeds_ptr.untyped_storage().nbytes() // inputs_embeds_ptr.element_size()
            - inputs_embeds_ptr.storage_offset(),
        ),
        (1,),
    )
    qsl = query_start_loc_ptr[: num_reqs + 1].long().tolist()
    for b, r in enumerate(idx_mapping_ptr[:num_reqs].long().tolist()):
        if r < 0:  # a padded row: the kernel would read before the tables
            continue
        length, computed = int(embeds_lens_ptr[r]), int(num_computed_tokens_ptr[r])
        if computed >= length:
            continue
        n = min(qsl[b + 1] - qsl[b], length - computed, token_blocks * TOKEN_BLOCK)
        if n <= 0:
            continue
        t = torch.arange(n)
        mask_addr = int(mask_ptrs_ptr[r].view(torch.int64))
        if mask_addr != 0:
            t = t[ptr.view(mask_addr, torch.int8, computed + n)[computed : computed + n] == 0]
        if t.numel() == 0:
            continue
        src = ptr.view(int(embeds_ptrs_ptr[r].view(torch.int64)), dtype, (computed + n) * hidden_size)
        src = src.view(computed + n, hidden_size)
        cols = torch.arange(hidden_size)
        dst[((qsl[b] + t) * int(inputs_embeds_stride)).unsqueeze(1) + cols] = src[computed + t]
