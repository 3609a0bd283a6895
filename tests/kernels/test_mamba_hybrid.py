"""``_scatter_num_accepted_kernel`` (hybrid models, every step): native vs interpreter, bit-exact; and vLLM's
``postprocess_state`` reaching it and ``_fill_num_accepted_kernel`` (an int num_sampled: a non-last
pipeline-parallel rank; its differential test is in test_option_kernels.py).

As in ``MambaHybridModelState.postprocess_state``: int32 idx_mapping (with -1 rows, as pipeline parallelism
filters them), int32 num_sampled (0 for chunked prefill, 1 otherwise, more with drafts), int32
num_accepted_tokens ``[max_num_reqs]`` starting as noise so untouched entries show.
"""

from __future__ import annotations

import types

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.v1.worker.gpu.model_states import mamba_hybrid as vmod

import mmcpu.kernels.model_states.mamba_hybrid  # noqa: F401  registers it even before NATIVE_MODULES names it

KERNEL = vmod._scatter_num_accepted_kernel


def make_case(num_reqs: int, extra: int, skip_rate: float):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_num_reqs = num_reqs + extra
        idx = torch.randperm(max_num_reqs, generator=g)[:num_reqs].to(torch.int32)
        idx[torch.rand(num_reqs, generator=g) < skip_rate] = -1
        num_sampled = torch.randint(-1, 5, (num_reqs + 2,), generator=g, dtype=torch.int32)
        num_accepted = torch.randint(-50, 50, (max_num_reqs,), generator=g, dtype=torch.int32)
        return Launch(
            grid=(num_reqs,),
            args=(idx, num_sampled, num_accepted),
            watch={"idx": idx, "num_sampled": num_sampled, "num_accepted": num_accepted},
        )

    return make


@pytest.mark.parametrize("num_reqs,extra,skip_rate", [(1, 0, 0.0), (1, 3, 0.5), (7, 5, 0.0), (64, 40, 0.3)])
def test_scatter_num_accepted(num_reqs, extra, skip_rate):
    assert differential(KERNEL, make_case(num_reqs, extra, skip_rate), range(5)) == 5


def test_dispatch_routes_launcher():
    state = types.SimpleNamespace(
        num_accepted_tokens_gpu=torch.full((6,), 9, dtype=torch.int32),
        _align_mode=False,
        _mamba_ctx=None,
        recoverssm=None,
    )
    idx = torch.tensor([4, -1, 0], dtype=torch.int32)
    with native_launches() as launched:
        vmod.MambaHybridModelState.postprocess_state(state, idx, torch.tensor([0, 3, 2], dtype=torch.int32))
    assert launched["_scatter_num_accepted_kernel"] == 1
    assert state.num_accepted_tokens_gpu.tolist() == [2, 9, 9, 9, 1, 9]
    with native_launches() as launched:
        vmod.MambaHybridModelState.postprocess_state(state, torch.tensor([1, -1, 5], dtype=torch.int32), 0)
    assert launched["_fill_num_accepted_kernel"] == 1
    assert state.num_accepted_tokens_gpu.tolist() == [2, 1, 9, 9, 1, 1]  # max(0, 1): the neutral value
