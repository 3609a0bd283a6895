"""Differential harness: launch a vLLM Triton kernel in the interpreter and its native version on twin
inputs, then compare every tensor either may have written.

A *case factory* ``make(seed) -> Launch`` must build fresh inputs from ``seed`` alone (call it twice, get two
independent but identical worlds, pointer tables included). ``Launch.watch`` lists every tensor of that world
- arguments and memory reached through pointer tables - so that writes to any of them, intended or not, are
compared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mmcpu.kernels import dispatch


@dataclass
class Launch:
    grid: Any
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    watch: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor (compared after the launch)
    keep: list[Any] = field(default_factory=list)  # anything that must stay alive (buffers behind pointers)


_ENTRIES: dict[Any, dispatch.NativeKernel] = {}


def native_entry(kernel: Any) -> dispatch.NativeKernel:
    """The registered native implementation of ``kernel``, guard checked once (fails the test if stale)."""
    if kernel not in _ENTRIES:
        dispatch.load_native_modules()
        entry, why = dispatch.guard(kernel.fn, kernel.arg_names)
        assert entry is not None, f"{kernel.fn.__name__}: {why}"
        _ENTRIES[kernel] = entry
    return _ENTRIES[kernel]


def run_interpreter(kernel: Any, launch: Launch) -> None:
    dispatch.interpret(kernel, launch.grid, *launch.args, **launch.kwargs)


def run_native(kernel: Any, launch: Launch) -> None:
    entry = native_entry(kernel)
    dispatch.run_native(entry, kernel.arg_names, launch.grid, launch.args, launch.kwargs)


def assert_same(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *, what: str, atol: dict[str, float] | None = None
) -> None:
    """Exact comparison (NaN == NaN, signed zeros distinguished), or within ``atol[name]`` for the names given."""
    assert ref.keys() == got.keys()
    for name in ref:
        a, b = ref[name], got[name]
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {name} shape/dtype differ"
        tol = (atol or {}).get(name)
        if tol is None:
            bad = a != b
            if a.is_floating_point():
                bad &= ~(a.isnan() & b.isnan())
                bad |= (a == 0) & (b == 0) & (a.signbit() != b.signbit())  # -0.0 vs +0.0 is a difference
            if bool(bad.any()):
                idx = bad.nonzero()[:5].tolist()
                raise AssertionError(
                    f"{what}: {name} differs at {idx} ({int(bad.sum())} elements): "
                    f"ref {[a[tuple(i)].item() for i in idx]} native {[b[tuple(i)].item() for i in idx]}"
                )
        else:
            torch.testing.assert_close(b, a, atol=tol, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {name}: {m}")  # noqa: B023


def differential(
    kernel: Any, make: Callable[[int], Launch], seeds: range | list[int], *, atol: dict[str, float] | None = None
) -> int:
    """Run every seed's case both ways and compare; returns how many cases ran."""
    n = 0
    for seed in seeds:
        ref, got = make(seed), make(seed)
        before = {k: v.clone() for k, v in got.watch.items()}
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        assert_same(ref.watch, got.watch, what=f"{kernel.fn.__name__} seed={seed}", atol=atol)
        assert before.keys() == got.watch.keys()
        n += 1
    return n


# Pointer tables (uint64 tensors of raw addresses) differ between the two worlds by construction, so they are not
# compared with each other; instead each must still hold its own original addresses after the launch.
PTR_TABLES: list[tuple[torch.Tensor, torch.Tensor]] = []


def pointer_table(tensors) -> torch.Tensor:
    """A uint64 table of ``tensors``' addresses, as vLLM builds them; checked untouched after the test."""
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)
    track_pointer_table(table)
    return table


def track_pointer_table(table: torch.Tensor) -> None:
    PTR_TABLES.append((table, table.clone()))


@contextmanager
def native_launches() -> Iterator[Counter]:
    """The dispatcher installed for the block (a vLLM launcher called inside goes the production way); yields a
    Counter that, after the block, holds the native launches made inside it, per kernel."""
    before = dispatch.STATS.native.copy()
    grown: Counter = Counter()
    dispatch.install("native")
    try:
        yield grown
    finally:
        dispatch.uninstall()
        grown.update(dispatch.STATS.native - before)


def bf16_matches_fp32_reference(kernel: Any, make: Callable[[int], Launch], seeds: range) -> None:
    """bf16 logits (the first argument, watched as "logits"): the interpreter cannot be the reference directly
    (it builds no bf16 constants and truncates on downcast), but these kernels upcast every load to fp32, so
    the reference is the interpreter on the fp32 upcast, rounded to bf16 - compared exactly."""
    for seed in seeds:
        got, ref = make(seed), make(seed)
        ref.args = (ref.args[0].float(), *ref.args[1:])
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        assert_same({"logits": ref.args[0].to(torch.bfloat16)}, {"logits": got.watch["logits"]}, what=f"seed {seed}")
