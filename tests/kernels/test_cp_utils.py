"""``_dcp_local_seq_lens_kernel`` (decode context parallelism): native vs interpreter, bit-exact.

int32 seq_lens and output as in ``InputBuffers``; every (dcp_size, dcp_rank, interleave) split is exercised,
including seq_lens shorter than one round and negative ones (not produced by vLLM, but they pin down the
kernel's truncating integer division). The output starts as noise so the zero padding up to max_num_reqs and
the untouched tail beyond it both show.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.v1.worker.gpu import cp_utils as vmod

KERNEL = vmod._dcp_local_seq_lens_kernel


def make_case(
    num_reqs: int, max_num_reqs: int, dcp_size: int, interleave: int, block: int = 128, negative: bool = False
):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        rank = seed % dcp_size
        low, high = (-5 * dcp_size * interleave, 5 * dcp_size * interleave) if negative else (0, 5000)
        seq_lens = torch.randint(low, high, (max_num_reqs + 3,), generator=g, dtype=torch.int32)
        seq_lens[: num_reqs // 3] %= dcp_size * interleave  # within the first round
        out = torch.randint(-100, 100, (max_num_reqs + 3,), generator=g, dtype=torch.int32)
        grid = ((max_num_reqs + block - 1) // block,)
        return Launch(
            grid=grid,
            args=(out, seq_lens, dcp_size, rank, interleave, num_reqs, max_num_reqs),
            kwargs={"BLOCK_SIZE": block},
            watch={"out": out, "seq_lens": seq_lens},
        )

    return make


@pytest.mark.parametrize(
    "num_reqs,max_num_reqs,dcp_size,interleave",
    [(1, 1, 2, 1), (5, 16, 2, 1), (37, 200, 4, 16), (256, 256, 8, 64), (0, 10, 2, 4)],
)
def test_dcp_local_seq_lens(num_reqs, max_num_reqs, dcp_size, interleave):
    assert differential(KERNEL, make_case(num_reqs, max_num_reqs, dcp_size, interleave), range(6)) == 6


def test_negative_seq_lens_truncating_division():
    assert differential(KERNEL, make_case(40, 64, 4, 8, block=16, negative=True), range(4)) == 4


def test_dispatch_routes_launcher():
    out = torch.full((8,), -1, dtype=torch.int32)
    seq_lens = torch.tensor([0, 1, 7, 8, 9, 100, 0, 0], dtype=torch.int32)
    with native_launches() as launched:
        vmod.prepare_dcp_local_seq_lens(out, seq_lens, 6, dcp_size=2, dcp_rank=1, cp_interleave=4)
    assert launched["_dcp_local_seq_lens_kernel"] == 1
    assert out.tolist() == [0, 0, 3, 4, 4, 48, 0, 0]
