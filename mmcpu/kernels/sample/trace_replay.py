"""Native ``vllm/v1/worker/gpu/sample/trace_replay.py``: ``--enable-trace-replay`` overwrites sampled tokens with a
request's recorded trace, step by step."""

from __future__ import annotations

import torch

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.sample.trace_replay",
    "_trace_replay_kernel",
    sha256="0ae3bece16b4c54cd1dc034414627af3a1f06816ea396823a4cca710a06734c7",
)
def _trace_replay_kernel(
    grid,
    sampled_ptr,
    idx_mapping_ptr,
    trace_token_ids_ptr,
    trace_token_ids_stride,
    trace_len_ptr,
    total_len_ptr,
    prompt_len_ptr,
):
    # Batch row b of request r: output token number total_len[r] - prompt_len[r] is the trace's, if it has one.
    n = grid[0]
    if n <= 0:
        return
    req = idx_mapping_ptr[:n].long()
    rows = (req >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return
    r = req[rows]
    trace_len = trace_len_ptr[r].long()
    step = total_len_ptr[r].long() - prompt_len_ptr[r].long()
    on = (trace_len > 0) & (step >= 0) & (step < trace_len)
    rows, r, step = rows[on], r[on], step[on]
    if rows.numel():
        flat = (
            trace_token_ids_ptr.reshape(-1)
            if trace_token_ids_ptr.is_contiguous()
            else trace_token_ids_ptr.as_strided(
                (
                    trace_token_ids_ptr.untyped_storage().nbytes() // trace_token_ids_ptr.element_size()
                    - trace_token_ids_ptr.storage_offset(),
                ),
                (1,),
            )
        )
        sampled_ptr[rows] = flat[r * int(trace_token_ids_stride) + step].to(torch.int64)
