"""``_gather_block_tables_kernel`` and ``_compute_slot_mappings_kernel``: native vs interpreter, bit-exact.

Both reach their block tables through uint64 pointer tables, so each world owns its tables and its pointer
table holds their addresses. The two worlds' pointer tables differ by construction, so they are not compared
with each other; instead every one is checked, after the runs, to still hold its own addresses. Destination
buffers start as garbage, so writes beyond what the kernel writes (or missing ones) show up.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_launches, pointer_table, run_native
from vllm.v1.worker.gpu import block_table as vmod

PAD_SLOT_ID = -1


def _garbage(g, *shape, dtype=torch.int32):
    return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)


def gather_case(num_groups: int, max_reqs: int, max_blocks: list[int], block: int = 1024):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=g))
        padded = int(torch.randint(num_reqs, max_reqs + 1, (1,), generator=g))  # grid rows >= real batch
        src = [torch.randint(0, 10**6, (max_reqs, m), generator=g, dtype=torch.int32) for m in max_blocks]
        dst = [_garbage(g, max_reqs, m) for m in max_blocks]
        # num_blocks sits in a wider buffer, so its row stride is not max_reqs (and the view is strided).
        wide = torch.zeros(num_groups, max_reqs + 5, dtype=torch.int32)
        for i, m in enumerate(max_blocks):
            wide[i] = torch.randint(0, m + 1, (max_reqs + 5,), generator=g, dtype=torch.int32)
        num_blocks = wide[:, :max_reqs]
        idx = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
        src_ptrs, dst_ptrs = pointer_table(src), pointer_table(dst)
        strides = torch.tensor([t.stride(0) for t in src], dtype=torch.int64)
        watch = {"idx": idx, "num_blocks": wide, "strides": strides}
        watch |= {f"src{i}": t for i, t in enumerate(src)} | {f"dst{i}": t for i, t in enumerate(dst)}
        return Launch(
            grid=(num_groups, padded),
            args=(idx, src_ptrs, dst_ptrs, strides, num_blocks, num_blocks.stride(0), num_reqs),
            kwargs={"BLOCK_SIZE": block},
            watch=watch,
            keep=[src, dst],
        )

    return make


@pytest.mark.parametrize(
    "num_groups,max_reqs,max_blocks,block",
    [
        (1, 4, [7], 1024),
        (2, 6, [28, 9], 1024),  # Whisper: full attention + cross attention
        (3, 5, [40, 3, 17], 16),  # BLOCK_SIZE smaller than a row: the kernel's loop runs several times
    ],
)
def test_gather_block_tables(num_groups, max_reqs, max_blocks, block):
    assert (
        differential(vmod._gather_block_tables_kernel, gather_case(num_groups, max_reqs, max_blocks, block), range(5))
        == 5
    )


def slots_case(
    block_sizes: list[int],
    max_reqs: int,
    max_model_len: int,
    *,
    cp_size: int = 1,
    cp_interleave: int = 1,
    block: int = 1024,
    dummies: bool = False,
):
    """``dummies``: some requests are dummy runs (idx_mapping -1), some groups have slot mapping disabled or
    are not DCP-sharded (the per-group flags are random either way)."""
    num_groups = len(block_sizes)

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=g))
        padded = int(torch.randint(num_reqs, max_reqs + 1, (1,), generator=g))
        query_lens = torch.randint(0, 9, (num_reqs,), generator=g)
        query_lens[torch.rand(num_reqs, generator=g) < 0.5] = 1  # decode steps
        num_tokens = int(query_lens.sum())
        max_tokens = num_tokens + int(torch.randint(0, 12, (1,), generator=g))
        qsl = torch.full((max_reqs + 1,), num_tokens, dtype=torch.int32)  # padded as prepare_inputs does
        qsl[0] = 0
        qsl[1 : num_reqs + 1] = query_lens.cumsum(0)
        qsl = qsl[: padded + 1]
        pos = _garbage(g, max_tokens + 3, dtype=torch.int64)
        for b in range(num_reqs):
            start = int(torch.randint(0, max_model_len - int(query_lens[b]) + 1, (1,), generator=g))
            pos[int(qsl[b]) : int(qsl[b + 1])] = torch.arange(start, start + int(query_lens[b]))
        tables = [
            torch.randint(0, 5000, (max_reqs, -(-max_model_len // (bs * cp_size))), generator=g, dtype=torch.int32)
            for bs in block_sizes
        ]
        ptrs = pointer_table(tables)
        strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64)
        sizes = torch.tensor(block_sizes, dtype=torch.int32)
        idx = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
        enabled = torch.ones(num_groups, dtype=torch.bool)
        sharded = torch.ones(num_groups, dtype=torch.bool)
        if dummies:
            idx[torch.rand(num_reqs, generator=g) < 0.3] = -1
            enabled = torch.rand(num_groups, generator=g) < 0.7
            sharded = torch.rand(num_groups, generator=g) < 0.5
        slots = _garbage(g, num_groups, max_tokens, dtype=torch.int64)
        cp_rank = int(torch.randint(0, cp_size, (1,), generator=g))
        watch = {
            "idx": idx,
            "qsl": qsl,
            "pos": pos,
            "strides": strides,
            "sizes": sizes,
            "enabled": enabled,
            "sharded": sharded,
            "slots": slots,
        } | {f"table{i}": t for i, t in enumerate(tables)}
        return Launch(
            grid=(num_groups, num_reqs + 1),
            args=(
                slots.shape[1],
                idx,
                qsl,
                pos,
                ptrs,
                strides,
                sizes,
                enabled,
                sharded,
                slots,
                slots.stride(0),
                cp_rank,
            ),
            kwargs={
                "CP_SIZE": cp_size,
                "CP_INTERLEAVE": cp_interleave,
                "PAD_ID": PAD_SLOT_ID,
                "TRITON_BLOCK_SIZE": block,
            },
            watch=watch,
            keep=[tables],
        )

    return make


@pytest.mark.parametrize(
    "block_sizes,max_reqs,max_model_len,block",
    [
        ([16], 4, 100, 1024),
        ([16, 32], 6, 448, 1024),
        ([4, 16, 64], 5, 300, 4),  # small TRITON_BLOCK_SIZE: several loop iterations per request
    ],
)
def test_compute_slot_mappings(block_sizes, max_reqs, max_model_len, block):
    make = slots_case(block_sizes, max_reqs, max_model_len, block=block)
    assert differential(vmod._compute_slot_mappings_kernel, make, range(5)) == 5


@pytest.mark.parametrize("cp_size,cp_interleave", [(2, 1), (4, 8)])
@pytest.mark.parametrize("dummies", [False, True])
def test_compute_slot_mappings_context_parallel(cp_size, cp_interleave, dummies):
    make = slots_case([16, 32], 4, 256, cp_size=cp_size, cp_interleave=cp_interleave, dummies=dummies)
    assert differential(vmod._compute_slot_mappings_kernel, make, range(4)) == 4


def test_compute_slot_mappings_dummy_requests_and_disabled_groups():
    """Dummy runs (idx_mapping -1) and groups without slot mapping get PAD_ID, never a block-table read."""
    make = slots_case([16, 32, 8], 6, 200, dummies=True)
    assert differential(vmod._compute_slot_mappings_kernel, make, range(8)) == 8
    padded = 0
    for seed in range(8):
        case = make(seed)
        run_native(vmod._compute_slot_mappings_kernel, case)
        qsl, idx, slots = case.watch["qsl"], case.watch["idx"], case.watch["slots"]
        for b in range(idx.shape[0]):
            for grp in range(slots.shape[0]):
                tokens = slots[grp, int(qsl[b]) : int(qsl[b + 1])]
                if int(idx[b]) < 0 or not bool(case.watch["enabled"][grp]):
                    assert bool((tokens == PAD_SLOT_ID).all())
                    padded += tokens.numel()
    assert padded > 0  # the cases did reach both rules


def _block_tables(monkeypatch):
    """A real vLLM ``BlockTables`` on CPU (the CPU worker's UvaBuffer: plain host tensors, no pinning)."""
    from vllm.v1.worker.cpu.buffer_utils import UvaBuffer
    from vllm.v1.worker.gpu import buffer_utils

    monkeypatch.setattr(buffer_utils, "UvaBuffer", UvaBuffer)
    return vmod.BlockTables(
        block_sizes=[16, 32],
        max_num_reqs=6,
        max_num_batched_tokens=40,
        max_num_blocks_per_group=[10, 5],
        device=torch.device("cpu"),
    )


def _step(bt: vmod.BlockTables) -> dict[str, torch.Tensor]:
    bt.append_block_ids(2, ([7, 3, 9], [4, 1]), overwrite=True)
    bt.append_block_ids(0, ([5], [8]), overwrite=True)
    bt.apply_staged_writes()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 20, 21, 21], dtype=torch.int32)
    pos = torch.cat([torch.arange(20), torch.tensor([3]), torch.zeros(4, dtype=torch.int64)])
    tables = bt.gather_block_tables(idx, num_reqs_padded=3)
    bt.compute_slot_mappings(idx, qsl, pos, num_tokens_padded=25)
    # The whole buffers: the kernels pad beyond what the launchers return.
    return {
        "slots": bt.slot_mappings.clone(),
        **{f"table{i}": t.clone() for i, t in enumerate(tables)},
        **{f"input_table{i}": t.clone() for i, t in enumerate(bt.input_block_tables)},
        **{f"staged{i}": t.gpu.clone() for i, t in enumerate(bt.block_tables)},
    }


def test_dispatch_routes_block_table_launchers(monkeypatch):
    ref = _step(_block_tables(monkeypatch))  # plain interpreter
    names = ("_gather_block_tables_kernel", "_compute_slot_mappings_kernel", "_apply_write_kernel")
    with native_launches() as launched:
        got = _step(_block_tables(monkeypatch))
    assert all(launched[k] > 0 for k in names), launched
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert bool((got["slots"][:, 21:] == PAD_SLOT_ID).all())
    assert got["table0"][0, :3].tolist() == [7, 3, 9] and got["table1"][1, :1].tolist() == [8]
