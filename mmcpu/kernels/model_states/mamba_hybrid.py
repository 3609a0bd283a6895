"""Native ``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``: per-step bookkeeping of hybrid (mamba) models."""

from __future__ import annotations

from mmcpu.kernels.dispatch import native


@native(
    "vllm.v1.worker.gpu.model_states.mamba_hybrid",
    "_scatter_num_accepted_kernel",
    sha256="3bfefe75dd1765df2ea8fc025a221c713ac4d1809de1a4e3f22289432ff5b69d",
)
def _scatter_num_accepted_kernel(grid, idx_mapping_ptr, num_sampled_ptr, num_accepted_ptr):
    # One program per batch row: num_accepted[idx_mapping[row]] = max(num_sampled[row], 1); -1 rows (filtered under
    # pipeline parallelism) are skipped.
    rows = grid[0]
    if rows <= 0:
        return
    req = idx_mapping_ptr[:rows]
    keep = (req >= 0).nonzero().flatten()
    if keep.numel() == 0:
        return
    value = num_sampled_ptr[:rows][keep].clamp_min(1)
    num_accepted_ptr[req[keep].long()] = value.to(num_accepted_ptr.dtype)


@native(
    "vllm.v1.worker.gpu.model_states.mamba_hybrid",
    "_fill_num_accepted_kernel",
    sha256="1c8ea4a64730954db4355dee52ea60ffdf0df99287214ed2f078da2d59f3f7d0",
)
def _fill_num_accepted_kernel(grid, idx_mapping_ptr, num_accepted_ptr, num_sampled):
    # One program per batch row: num_accepted[idx_mapping[row]] = num_sampled (one value); -1 rows are skipped.
    rows = grid[0]
    if rows <= 0:
        return
    req = idx_mapping_ptr[:rows]
    keep = req[req >= 0].long()
    if keep.numel():
        num_accepted_ptr[keep] = num_sampled
