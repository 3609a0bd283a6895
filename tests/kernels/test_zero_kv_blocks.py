"""``_zero_kv_blocks_kernel`` (``KVBlockZeroer``): native vs interpreter, bit-exact.

Each world allocates its own KV-cache tensors and builds its own segment tables (addresses, block strides, page
sizes) with vLLM's ``KVBlockZeroer`` (fake attention groups, real address/stride/page-size logic): a
block-outermost layout (one segment per buffer), a K/V-outermost layout (two segments per buffer), logical
blocks of two kernel blocks (``ratio`` 2: two virtual segments), and two KV-cache groups whose pages differ in
size (per-segment strides and page sizes). Caches start as noise; every buffer is compared after the launch.
"""

from __future__ import annotations

import types

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker import utils as vmod

KERNEL = vmod._zero_kv_blocks_kernel
KERNEL_BS, HEADS = 16, 2


def _kv_cache(g, layout: str, blocks: int, head: int, dtype: torch.dtype) -> torch.Tensor:
    """A layer's cache as the zeroer sees it: blocks at dim 0. "kv_outer": K and V outermost in memory
    ([2, blocks, ...] viewed as [blocks, 2, ...]), so they are separate segments."""
    if layout == "kv_outer":
        return (torch.randn(2, blocks, KERNEL_BS, HEADS, head, generator=g) * 5).to(dtype).transpose(0, 1)
    return (torch.randn(blocks, 2, HEADS, KERNEL_BS, head, generator=g) * 5).to(dtype)


def build_world(
    seed: int,
    layout: str,
    dtype: torch.dtype,
    num_layers: int,
    num_blocks: int,
    ratio: int,
    head_sizes: tuple[int, ...] = (32,),
):
    """One KV-cache group per entry of ``head_sizes`` (so pages of different sizes), ``num_layers`` each."""
    g = torch.Generator().manual_seed(seed)
    ctx, groups = {}, []
    for gid, head in enumerate(head_sizes):
        spec = FullAttentionSpec(block_size=KERNEL_BS * ratio, num_kv_heads=HEADS, head_size=head, dtype=dtype)
        names = []
        for i in range(num_layers):
            kv = _kv_cache(g, layout, num_blocks * ratio, head, dtype)
            names.append(f"group{gid}.layer{i}")
            ctx[names[-1]] = types.SimpleNamespace(kv_cache=kv)
        groups.append(
            types.SimpleNamespace(kv_cache_spec=spec, kv_cache_group_id=gid, layer_names=names, kernel_block_stride=0)
        )
    zeroer = vmod.KVBlockZeroer(torch.device("cpu"), groups, [KERNEL_BS] * len(head_sizes), ctx, num_blocks)
    return zeroer, {n: c.kv_cache for n, c in ctx.items()}, g


def make_case(
    layout: str,
    dtype: torch.dtype,
    num_layers: int,
    num_blocks: int,
    n_ids: int,
    ratio: int = 1,
    head_sizes: tuple[int, ...] = (32,),
):
    def make(seed: int) -> Launch:
        zeroer, caches, g = build_world(seed, layout, dtype, num_layers, num_blocks, ratio, head_sizes)
        seg_addrs, strides, pages, max_chunks, blk_size, n_segs = zeroer._meta
        ids = torch.randperm(num_blocks, generator=g)[:n_ids].to(torch.int64)
        return Launch(
            grid=(n_ids, n_segs, max_chunks),
            args=(seg_addrs, strides, pages, ids),
            kwargs={"BLOCK_SIZE": blk_size},
            # The address tables differ between worlds by construction, so they are not compared.
            watch={**caches, "ids": ids, "strides": strides, "pages": pages},
            keep=[zeroer],
        )

    return make


@pytest.mark.parametrize(
    "layout,dtype,num_layers,num_blocks,n_ids,ratio",
    [
        ("cpu", torch.float32, 1, 4, 1, 1),
        ("cpu", torch.bfloat16, 3, 12, 5, 1),
        ("kv_outer", torch.float16, 2, 10, 4, 1),
        ("cpu", torch.float32, 2, 6, 3, 2),
        ("kv_outer", torch.float32, 1, 6, 3, 2),
    ],
)
def test_zero_kv_blocks(layout, dtype, num_layers, num_blocks, n_ids, ratio):
    make = make_case(layout, dtype, num_layers, num_blocks, n_ids, ratio)
    assert make(0).grid[1] == num_layers * ratio * (2 if layout == "kv_outer" else 1)  # the segments meant
    assert differential(KERNEL, make, range(3)) == 3


@pytest.mark.parametrize("layout", ["cpu", "kv_outer"])
def test_zero_kv_blocks_groups_of_different_page_sizes(layout):
    # Pages of 2048 and 768 words: the smaller segments stop early in their last chunk, or skip it.
    make = make_case(layout, torch.float32, 2, 7, 4, head_sizes=(64, 24))
    assert len(set(make(0).args[2].tolist())) == 2
    assert differential(KERNEL, make, range(3)) == 3


def test_fewer_chunks_than_a_page():
    # A grid with fewer chunks than a page holds (the launcher never makes one) zeroes only the chunks it has.
    base = make_case("cpu", torch.float32, 2, 8, 3, ratio=2)

    def make(seed: int) -> Launch:
        case = base(seed)
        case.grid = (case.grid[0], case.grid[1], case.grid[2] - 1)
        return case

    assert base(0).grid[2] > 1
    assert differential(KERNEL, make, range(3)) == 3


def test_dispatch_routes_launcher():
    zeroer, caches, _ = build_world(0, "cpu", torch.float32, 2, 6, 1)
    assert zeroer._meta is not None
    with native_launches() as launched:
        zeroer.zero_block_ids([4, 1])
    assert launched["_zero_kv_blocks_kernel"] == 1
    for kv in caches.values():
        assert bool((kv[[1, 4]] == 0).all()) and bool((kv[[0, 2, 3, 5]] != 0).all())
