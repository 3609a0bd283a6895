"""``_num_nans_kernel``: native vs interpreter, bit-exact.

The reference needs ``libdevice.isnan``, which :mod:`mmcpu.kernels.interpreter` (applied by conftest) maps to
numpy (the kernel imports libdevice from ``torch._inductor.runtime.triton_helpers``, the same module object).
fp32, bf16 and fp16 logits all run in the interpreter (the masked load's ``other=0`` needs no bf16 constant).
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.v1.worker.gpu.metrics import logits as vmod

KERNEL = vmod._num_nans_kernel


def make_case(num_reqs: int, vocab: int, dtype: torch.dtype = torch.float32, block: int = 8192):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        # Padded rows (stride > vocab) with NaNs in the padding and an extra NaN row prove stride and row count.
        logits = torch.randn(num_reqs + 1, vocab + 5, generator=g)
        rate = (
            torch.rand(num_reqs + 1, 1, generator=g)
            * torch.tensor([0.0, 0.01, 0.5])[torch.randint(0, 3, (num_reqs + 1, 1), generator=g)]
        )
        logits[torch.rand(logits.shape, generator=g) < rate] = float("nan")
        logits[:, vocab:] = float("nan")
        logits[num_reqs] = float("nan")
        logits[0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])  # not NaN
        logits = logits.to(dtype)
        out = torch.full((num_reqs + 2,), -7, dtype=torch.int32)
        return Launch(
            grid=(num_reqs,),
            args=(logits, logits.stride(0), out, vocab),
            kwargs={"BLOCK_SIZE": block},
            watch={"logits": logits, "num_nans": out},
        )

    return make


@pytest.mark.parametrize("num_reqs,vocab,block", [(1, 100, 8192), (3, 20000, 8192), (8, 5003, 1024)])
def test_num_nans_fp32(num_reqs, vocab, block):
    assert differential(KERNEL, make_case(num_reqs, vocab, block=block), range(4)) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_num_nans_half(dtype):
    assert differential(KERNEL, make_case(5, 3001, dtype), range(3)) == 3


def test_dispatch_routes_launcher():
    logits = torch.randn(4, 1000)
    logits[2, [5, 9]] = float("nan")
    with native_launches() as launched:
        num_nans = vmod.get_num_nans(logits)
    assert launched["_num_nans_kernel"] == 1
    assert num_nans.tolist() == [0, 0, 2, 0]
