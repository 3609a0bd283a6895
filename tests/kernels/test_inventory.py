"""Inventory: every @triton.jit function of the installed vLLM's MRV2 worker (and the sampler op and KV zeroer
it calls) is classified in ``mmcpu.kernels.reachability.KERNELS``; every kernel a serving request can reach on CPU
has a native implementation whose guard (argument names + source hash) matches the installed code.

Fails when vLLM gains a kernel nobody classified, when a reachable kernel has no native version, or when a
kernel's code moved since its native version was written. The first two are also what the image build and the
engine's start refuse (``mmcpu.kernels.check``, tested in test_check.py); this file adds the checks that only
keep the list honest (kernels vLLM no longer has, stale natives of unreachable kernels, the scan itself).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from mmcpu.kernels import check, dispatch, reachability
from mmcpu.kernels.reachability import KERNELS


@pytest.fixture(scope="module")
def kernels():
    found = reachability.installed_kernels()
    assert len(found) > 30, f"only {len(found)} kernels found: is TRITON_INTERPRET=1 set before vLLM imports?"
    return found


def test_every_kernel_is_classified(kernels):
    unclassified = sorted(set(kernels) - set(KERNELS))
    gone = sorted(set(KERNELS) - set(kernels))
    assert not unclassified, (
        f"new Triton kernels in vLLM, classify them in mmcpu/kernels/reachability.py: {unclassified}"
    )
    assert not gone, f"classified kernels no longer in vLLM: {gone}"
    bad = {k: v for k, v in KERNELS.items() if not reachability.is_valid_verdict(v)}
    assert not bad, bad


def test_every_reachable_kernel_is_native_and_guard_matches(kernels):
    """The image build's and the engine start's check (mmcpu.kernels.check), on the installed vLLM."""
    result = check.run()
    assert not result.problems, [p.line() for p in result.problems]
    assert result.reachable == len(reachability.reachable()) > 20


def test_every_registered_native_kernel_exists_and_guard_matches(kernels):
    """No native code for a kernel vLLM does not have; and none gone stale (also the few written for kernels
    classified unreachable, e.g. speculative decoding's idx expansion: cheap, and ready if that path opens)."""
    dispatch.load_native_modules()
    registered = {f"{m}:{n}" for m, n in dispatch.REGISTRY}
    assert registered <= set(KERNELS), sorted(registered - set(KERNELS))
    stale = {
        k: why
        for k in registered
        for entry, why in [dispatch.guard(kernels[k].fn, kernels[k].arg_names)]
        if entry is None
    }
    assert not stale, stale


def test_scan_finds_kernels_in_every_scanned_file(kernels):
    """The scan itself can fail: each vLLM source file with '@triton.jit' yields at least one kernel."""
    import vllm

    root = Path(vllm.__file__).parent
    files = [p for p in reachability.scanned_files(root) if "@triton.jit" in p.read_text()]
    assert len(files) > 15
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts) for p in files}
    assert modules <= {k.split(":")[0] for k in kernels}


def test_scan_finds_every_jit_function_of_every_scanned_file(kernels):
    """As many kernels per module as its source has ``@triton.jit`` decorators, also those beneath
    ``@triton.heuristics`` (vLLM 0.32's recoverssm kernel), which a scan of plain jit objects missed."""
    import vllm

    root = Path(vllm.__file__).parent
    per_module = {}
    for key in kernels:
        per_module[key.split(":")[0]] = per_module.get(key.split(":")[0], 0) + 1
    wrapped = 0
    for path in reachability.scanned_files(root):
        source = path.read_text()
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        decorated = len(re.findall(r"^@triton\.jit\b", source, re.M))
        assert per_module.get(module, 0) == decorated, module
        wrapped += len(re.findall(r"^@triton\.(?:heuristics|autotune)\(", source, re.M))
    assert wrapped > 0  # the case this test is for exists in the installed vLLM
    assert "vllm.v1.worker.gpu.model_states.recoverssm:_postprocess_recoverssm_align_kernel" in kernels


@triton.heuristics({"WIDTH": lambda args: triton.next_power_of_2(args["n"]) * 2})
@triton.jit
def _heuristic_kernel(out_ptr, n, WIDTH: tl.constexpr):
    offs = tl.arange(0, WIDTH)
    tl.store(out_ptr + offs, offs, mask=offs < n)


def test_jit_function_unwraps_wrappers():
    from triton.runtime.interpreter import InterpretedFunction

    inner = reachability.jit_function(_heuristic_kernel)
    assert isinstance(inner, InterpretedFunction) and inner.fn.__name__ == "_heuristic_kernel"
    assert reachability.jit_function(inner) is inner
    assert reachability.jit_function(len) is None and reachability.jit_function(None) is None


def test_launch_through_a_heuristics_wrapper_reaches_the_native_version(monkeypatch):
    """The dispatcher sees the wrapped function's launch with the heuristic's argument filled in."""
    inner = reachability.jit_function(_heuristic_kernel)
    seen = []

    def impl(grid, out_ptr, n, WIDTH):
        seen.append((grid, n, WIDTH))
        out_ptr[:n] = torch.arange(n) * 10

    entry = dispatch.NativeKernel(
        __name__, "_heuristic_kernel", dispatch.kernel_source_sha256(inner.fn), ("out_ptr", "n", "WIDTH"), impl
    )
    monkeypatch.setitem(dispatch.REGISTRY, entry.key, entry)
    ref = torch.zeros(8, dtype=torch.int64)
    _heuristic_kernel[(1,)](ref, 3)  # not installed: the interpreter
    assert ref[:3].tolist() == [0, 1, 2]
    got = torch.zeros(8, dtype=torch.int64)
    dispatch.install("native")
    try:
        _heuristic_kernel[(1,)](got, 3)
    finally:
        dispatch.uninstall()
    assert seen == [((1,), 3, 8)] and got[:3].tolist() == [0, 10, 20]
