"""``_zero_kv_blocks_kernel`` (``KVBlockZeroer``): native vs interpreter, bit-exact.

Each world allocates its own KV-cache tensors and builds its own segment-address table with vLLM's
``KVBlockZeroer`` (fake attention groups, real address/page-size logic): the CPU backend's block-outermost layout
(one segment per buffer), a K/V-outermost layout (two segments per buffer) and logical blocks of two kernel
blocks (``ratio`` 2). Caches start as noise; every buffer is compared after the launch.
"""

from __future__ import annotations

import types

import pytest
import torch
from diff import Launch, differential, native_launches

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker import utils as vmod

KERNEL = vmod._zero_kv_blocks_kernel


class KVOuterBackend(CPUAttentionBackend):
    """A backend whose cache is ``[2, num_blocks, ...]`` (K/V outermost), as FlashAttention's."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return 2, num_blocks, block_size, num_kv_heads, head_size


def build_world(seed: int, layout: str, dtype: torch.dtype, num_layers: int, num_blocks: int, ratio: int):
    g = torch.Generator().manual_seed(seed)
    kernel_bs, heads, head = 16, 2, 32
    backend = CPUAttentionBackend if layout == "cpu" else KVOuterBackend
    spec = FullAttentionSpec(block_size=kernel_bs * ratio, num_kv_heads=heads, head_size=head, dtype=dtype)
    shape = backend.get_kv_cache_shape(num_blocks * ratio, kernel_bs, heads, head)
    ctx, names = {}, []
    for i in range(num_layers):
        kv = (torch.randn(shape, generator=g) * 5).to(dtype)
        names.append(f"layer.{i}")
        ctx[names[-1]] = types.SimpleNamespace(kv_cache=kv)
    group = types.SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=0, backend=backend, layer_names=names)
    zeroer = vmod.KVBlockZeroer(torch.device("cpu"), pin_memory=False, attn_groups_iter=[group],
                                kernel_block_sizes=[kernel_bs], cache_dtype="auto", static_forward_context=ctx)
    return zeroer, {n: c.kv_cache for n, c in ctx.items()}, g


def make_case(layout: str, dtype: torch.dtype, num_layers: int, num_blocks: int, n_ids: int, ratio: int = 1):
    def make(seed: int) -> Launch:
        zeroer, caches, g = build_world(seed, layout, dtype, num_layers, num_blocks, ratio)
        seg_addrs, page_size_el, blk_size, n_segs = zeroer._meta
        ids = torch.randperm(num_blocks, generator=g)[:n_ids].to(torch.int64)
        grid = (n_ids * n_segs * (page_size_el // blk_size),)
        return Launch(grid=grid, args=(seg_addrs, ids, n_ids),
                      kwargs={"N_SEGS": n_segs, "PAGE_SIZE_EL": page_size_el, "BLOCK_SIZE": blk_size},
                      # The address tables differ between worlds by construction, so they are not compared.
                      watch={**caches, "ids": ids}, keep=[zeroer])

    return make


@pytest.mark.parametrize("layout,dtype,num_layers,num_blocks,n_ids,ratio", [
    ("cpu", torch.float32, 1, 4, 1, 1),
    ("cpu", torch.bfloat16, 3, 12, 5, 1),
    ("kv_outer", torch.float16, 2, 10, 4, 1),
    ("cpu", torch.float32, 2, 6, 3, 2),
])
def test_zero_kv_blocks(layout, dtype, num_layers, num_blocks, n_ids, ratio):
    assert differential(KERNEL, make_case(layout, dtype, num_layers, num_blocks, n_ids, ratio), range(3)) == 3


def test_partial_grid():
    # A grid that stops inside a block (the launcher never does this) zeroes exactly the chunks it covers.
    base = make_case("cpu", torch.float32, 2, 8, 3, ratio=2)  # 2 segments x 4 chunks per block

    def make(seed: int) -> Launch:
        case = base(seed)
        case.grid = (case.grid[0] - 3,)
        return case

    assert differential(KERNEL, make, range(3)) == 3


def test_block_size_not_dividing_page():
    # The launcher picks a BLOCK_SIZE dividing the page; with one that does not, the page's tail stays untouched.
    base = make_case("cpu", torch.float32, 2, 8, 3)  # 2048-word blocks in memory

    def make(seed: int) -> Launch:
        case = base(seed)
        case.kwargs = {**case.kwargs, "PAGE_SIZE_EL": 1536, "BLOCK_SIZE": 1024}
        case.grid = (3 * case.kwargs["N_SEGS"],)
        return case

    assert differential(KERNEL, make, range(3)) == 3


def test_dispatch_routes_launcher():
    zeroer, caches, _ = build_world(0, "cpu", torch.float32, 2, 6, 1)
    with native_launches() as launched:
        zeroer.zero_block_ids([4, 1])
    assert launched["_zero_kv_blocks_kernel"] == 1
    for kv in caches.values():
        assert bool((kv[[1, 4]] == 0).all()) and bool((kv[[0, 2, 3, 5]] != 0).all())
