"""``_apply_write_kernel``: native vs interpreter, bit-exact, single-group and fused multi-group.

Writes are as ``StagedWriteTensor`` / ``FusedStagedWriter`` stage them (row, start column, a run of values,
cumulative lengths), in slices of larger staging buffers with garbage beyond the launch. Some cases overlap
writes on purpose: programs run in order, so the later write must win. Runs may pass the end of a row (the
kernel addresses row * stride + start + i, so they continue into the next row); the tests cover that too.
Multi-group: each world owns its group tables and its pointer table; pointer tables are checked to still hold
their own addresses afterwards (they differ between worlds by construction, so they are not compared).
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_launches, track_pointer_table
from vllm.v1.worker.gpu import buffer_utils as vmod


def _random(g, shape, dtype):
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype) * 100
        x.view(-1)[::7] = float("nan")
        return x
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dtype)


def _writes(g, n: int, num_rows: int, cols: int, overlap: bool):
    """n staged writes into a [num_rows, cols] table: rows, starts, lengths (a run may spill into the next row)."""
    rows = torch.randint(0, num_rows - 1, (n,), generator=g)
    starts = torch.randint(0, cols, (n,), generator=g)
    lens = torch.randint(0, cols + 1, (n,), generator=g)
    if overlap and n > 1:  # the last write lands on the first one's row, overlapping it
        rows[-1], starts[-1], lens[-1] = rows[0], starts[0], max(1, int(lens[0]))
    return rows, starts, lens


def _staging(g, values: torch.Tensor, spare: int = 4) -> torch.Tensor:
    """``values`` as the launch sees them: the front of a larger int32 staging buffer full of garbage."""
    buf = torch.randint(-(2**31), 2**31 - 1, (values.numel() + spare,), generator=g, dtype=torch.int64)
    buf = buf.to(torch.int32)
    buf[: values.numel()] = values
    return buf[: values.numel()]


def single_case(
    num_rows: int,
    cols: int,
    max_writes: int,
    dtype: torch.dtype,
    *,
    one_d: bool = False,
    overlap: bool = False,
    block: int = 1024,
):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(1, max_writes + 1, (1,), generator=g))
        if one_d:  # e.g. total_len / num_computed_tokens: stage_write_elem, one value per write
            out = _random(g, (num_rows,), dtype)
            rows = torch.randperm(num_rows, generator=g)[:n]
            starts, lens = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)
        else:
            out = _random(g, (num_rows, cols), dtype)
            rows, starts, lens = _writes(g, n, num_rows, cols, overlap)
        contents = _random(g, (int(lens.sum()) + 3,), dtype)[: int(lens.sum())]
        indices, starts_t, cu = _staging(g, rows), _staging(g, starts), _staging(g, lens.cumsum(0))
        watch = {"out": out, "indices": indices, "starts": starts_t, "contents": contents, "cu_lens": cu}
        return Launch(
            grid=(n,),
            args=(out, out.stride(0), indices, starts_t, contents, cu, None),
            kwargs={"BLOCK_SIZE": block, "MULTI_GROUP": False},
            watch=watch,
        )

    return make


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("num_rows,cols,max_writes,block", [(4, 9, 3, 1024), (9, 40, 6, 16)])
def test_apply_write_single_group(dtype, num_rows, cols, max_writes, block):
    make = single_case(num_rows, cols, max_writes, dtype, block=block)
    assert differential(vmod._apply_write_kernel, make, range(4)) == 4


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_apply_write_single_group_1d(dtype):
    assert differential(vmod._apply_write_kernel, single_case(12, 1, 6, dtype, one_d=True), range(4)) == 4


def test_apply_write_single_group_overlapping_writes():
    make = single_case(3, 12, 5, torch.int32, overlap=True, block=8)
    assert differential(vmod._apply_write_kernel, make, range(6)) == 6


def multi_case(num_rows: int, cols: list[int], max_writes: int, *, overlap: bool = False, block: int = 1024):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        tables = [_random(g, (num_rows, c), torch.int32) for c in cols]
        ptrs = torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64)
        track_pointer_table(ptrs)
        strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64)
        gids, rows, starts, lens = [], [], [], []
        for group, c in enumerate(cols):  # FusedStagedWriter orders writes by group
            n = int(torch.randint(0, max_writes + 1, (1,), generator=g))
            r, s, ln = _writes(g, n, num_rows, c, overlap)
            gids += [group] * n
            rows.append(r), starts.append(s), lens.append(ln)
        if not gids:
            gids, rows, starts, lens = [0], [torch.tensor([1])], [torch.tensor([0])], [torch.tensor([2])]
        rows, starts, lens = torch.cat(rows), torch.cat(starts), torch.cat(lens)
        contents = _random(g, (int(lens.sum()),), torch.int32)
        gid_t = _staging(g, torch.tensor(gids))
        indices, starts_t, cu = _staging(g, rows), _staging(g, starts), _staging(g, lens.cumsum(0))
        watch = {
            "strides": strides,
            "indices": indices,
            "starts": starts_t,
            "contents": contents,
            "cu_lens": cu,
            "group_ids": gid_t,
        } | {f"table{i}": t for i, t in enumerate(tables)}
        return Launch(
            grid=(len(gids),),
            args=(ptrs, strides, indices, starts_t, contents, cu, gid_t),
            kwargs={"BLOCK_SIZE": block, "MULTI_GROUP": True},
            watch=watch,
            keep=[tables],
        )

    return make


@pytest.mark.parametrize(
    "num_rows,cols,max_writes,block",
    [
        (4, [7, 7], 3, 1024),  # Whisper: self- and cross-attention block tables
        (6, [30, 5, 12], 4, 8),
    ],
)
def test_apply_write_multi_group(num_rows, cols, max_writes, block):
    make = multi_case(num_rows, cols, max_writes, block=block)
    assert differential(vmod._apply_write_kernel, make, range(5)) == 5


def test_apply_write_multi_group_overlapping_writes():
    assert differential(vmod._apply_write_kernel, multi_case(3, [10, 6], 4, overlap=True), range(5)) == 5


def _staged_step(monkeypatch) -> dict[str, torch.Tensor]:
    """vLLM's own launchers: one StagedWriteTensor (single group) and a FusedStagedWriter over two tables."""
    from vllm.v1.worker.cpu.buffer_utils import UvaBuffer

    monkeypatch.setattr(vmod, "UvaBuffer", UvaBuffer)  # what the CPU worker installs: host tensors, no pinning
    cpu = torch.device("cpu")
    tokens = vmod.StagedWriteTensor((4, 10), dtype=torch.int32, device=cpu)
    tokens.stage_write(2, 0, [5, 6, 7])
    tokens.stage_write(0, 4, [1, 2])
    tokens.apply_write()
    lens = vmod.StagedWriteTensor(4, dtype=torch.int64, device=cpu)
    lens.stage_write_elem(3, 11)
    lens.apply_write()
    groups = [vmod.StagedWriteTensor((4, 6), dtype=torch.int32, device=cpu) for _ in range(2)]
    groups[0].stage_write(1, 0, [9, 8])
    groups[1].stage_write(1, 2, [4])
    groups[1].stage_write(3, 0, [3, 3, 3])
    ptrs = torch.tensor([t.gpu.data_ptr() for t in groups], dtype=torch.uint64)
    strides = torch.tensor([t.gpu.stride(0) for t in groups], dtype=torch.int64)
    vmod.FusedStagedWriter(cpu, 8).apply(groups, ptrs, strides)
    return {
        "tokens": tokens.gpu.clone(),
        "lens": lens.gpu.clone(),
        **{f"group{i}": t.gpu.clone() for i, t in enumerate(groups)},
    }


def test_dispatch_routes_apply_write(monkeypatch):
    ref = _staged_step(monkeypatch)  # plain interpreter
    with native_launches() as launched:
        got = _staged_step(monkeypatch)
    assert launched["_apply_write_kernel"] == 3
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert got["tokens"][2, :3].tolist() == [5, 6, 7] and got["group1"][3, :3].tolist() == [3, 3, 3]
