"""Inventory: every @triton.jit function of the installed vLLM's MRV2 worker (and the sampler op and KV zeroer
it calls) is classified in ``mmcpu.kernels.reachability.KERNELS``; every kernel a serving request can reach on CPU
has a native implementation whose guard (argument names + source hash) matches the installed code.

Fails when vLLM gains a kernel nobody classified, when a reachable kernel has no native version, or when a
kernel's code moved since its native version was written. The first two are also what the image build and the
engine's start refuse (``mmcpu.kernels.check``, tested in test_check.py); this file adds the checks that only
keep the list honest (kernels vLLM no longer has, stale natives of unreachable kernels, the scan itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
    assert not unclassified, f"new Triton kernels in vLLM, classify them in mmcpu/kernels/reachability.py: " \
        f"{unclassified}"
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
    stale = {k: why for k in registered for entry, why in [dispatch.guard(kernels[k].fn, kernels[k].arg_names)]
             if entry is None}
    assert not stale, stale


def test_scan_finds_kernels_in_every_scanned_file(kernels):
    """The scan itself can fail: each vLLM source file with '@triton.jit' yields at least one kernel."""
    import vllm

    root = Path(vllm.__file__).parent
    files = [p for p in reachability.scanned_files(root) if "@triton.jit" in p.read_text()]
    assert len(files) > 15
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts) for p in files}
    assert modules <= {k.split(":")[0] for k in kernels}
