"""``_prepare_rope_positions_kernel`` (M-RoPE / XD-RoPE positions): native vs interpreter, bit-exact.

Inputs follow ``RopeState``: int64 positions ``[num_dims, max_num_tokens + 1]``, int32 staged prefill positions
``[max_num_reqs * num_dims, max_model_len]``, int32 per-request delta / prefill_len / num_computed, int32
idx_mapping and query_start_loc. Batches mix chunked-prefill and decode requests; the output buffer starts as
noise so that any write outside the scheduled tokens shows.
"""

from __future__ import annotations

import types

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.v1.worker.gpu.mm import rope as vmod

KERNEL = vmod._prepare_rope_positions_kernel


def make_case(num_reqs: int, num_dims: int, has_delta: bool, max_query: int, block_size: int = 1024):
    max_num_reqs, max_model_len = num_reqs + 4, 3 * max_query + 64

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        req = torch.randperm(max_num_reqs, generator=g)[:num_reqs]
        prefill_len = torch.randint(1, 2 * max_query, (max_num_reqs,), generator=g, dtype=torch.int32)
        # Decode requests (num_computed >= prefill_len) take 1-3 tokens; prefill requests a chunk that stays
        # inside their prefill.
        decode = torch.rand(max_num_reqs, generator=g) < 0.5
        computed = torch.where(
            decode,
            prefill_len + torch.randint(0, max_query, (max_num_reqs,), generator=g, dtype=torch.int32),
            (torch.rand(max_num_reqs, generator=g) * prefill_len.float()).to(torch.int32),
        )
        qlen = torch.where(
            decode[req],
            torch.randint(1, 4, (num_reqs,), generator=g),
            1 + (torch.rand(num_reqs, generator=g) * (prefill_len[req] - computed[req]).float()).long(),
        )
        if num_reqs > 2:
            qlen[1] = 0  # an empty query: nothing written
        qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
        qsl[1 : num_reqs + 1] = torch.cumsum(qlen, 0).to(torch.int32)
        qsl[num_reqs + 1 :] = qsl[num_reqs]
        max_num_tokens = int(qsl[num_reqs]) + 9
        positions = torch.randint(-(10**9), 10**9, (num_dims, max_num_tokens + 1), generator=g, dtype=torch.int64)
        prefill = torch.randint(0, 10**6, (max_num_reqs * num_dims, max_model_len), generator=g, dtype=torch.int32)
        delta = (
            torch.randint(-500, 0, (max_num_reqs,), generator=g, dtype=torch.int32)
            if has_delta
            else torch.zeros(max_num_reqs, dtype=torch.int32)
        )
        idx = req.to(torch.int32)
        return Launch(
            grid=(num_reqs,),
            args=(
                positions,
                positions.stride(0),
                prefill,
                num_dims * max_model_len,
                max_model_len,
                delta,
                idx,
                qsl,
                prefill_len,
                computed,
            ),
            kwargs={"BLOCK_SIZE": block_size, "NUM_DIMS": num_dims},
            watch={
                "positions": positions,
                "prefill": prefill,
                "delta": delta,
                "idx": idx,
                "qsl": qsl,
                "prefill_len": prefill_len,
                "computed": computed,
            },
        )

    return make


@pytest.mark.parametrize("num_reqs,max_query", [(1, 5), (1, 1200), (4, 40), (9, 300)])
def test_mrope(num_reqs, max_query):
    assert differential(KERNEL, make_case(num_reqs, 3, True, max_query), range(4)) == 4


@pytest.mark.parametrize("num_dims", [3, 4])
def test_xdrope(num_dims):
    assert differential(KERNEL, make_case(6, num_dims, False, 60), range(4)) == 4


def test_small_block_many_iterations():
    # BLOCK_SIZE only tiles the kernel's loop; a small one exercises multi-block queries cheaply.
    assert differential(KERNEL, make_case(5, 3, True, 100, block_size=16), range(3)) == 3


def test_dispatch_routes_launcher():
    case = make_case(4, 3, True, 30)(0)
    positions, _, prefill, _, max_model_len, delta, idx, qsl, prefill_len, computed = case.args
    state = types.SimpleNamespace(
        positions=positions,
        prefill_positions=types.SimpleNamespace(gpu=prefill),
        prefill_delta=types.SimpleNamespace(gpu=delta),
        num_dims=3,
        max_model_len=max_model_len,
    )
    with native_launches() as launched:
        vmod.RopeState.prepare_positions(state, idx, qsl[:5], prefill_len, computed)
    assert launched["_prepare_rope_positions_kernel"] == 1
