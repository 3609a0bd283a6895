"""Inventory: every @triton.jit function of the installed vLLM's MRV2 worker (and the sampler op and KV zeroer
it calls) is classified in ``reachability.KERNELS``; every kernel a serving request can reach on CPU has a
native implementation whose guard (argument names + source hash) matches the installed code.

Fails when vLLM gains a kernel nobody classified, when a reachable kernel has no native version, or when a
kernel's code moved since its native version was written (the dispatcher would then fall back to the
interpreter at run time, with a WARNING).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
from reachability import KERNELS

from mmcpu.kernels import dispatch

ROOTS = ("vllm.v1.worker.gpu",)
SINGLE_MODULES = ("vllm.v1.worker.utils", "vllm.v1.sample.ops.topk_topp_triton")


def _modules() -> list[str]:
    import vllm.v1.worker.gpu as gpu

    names = [gpu.__name__]
    names += [m.name for m in pkgutil.walk_packages(gpu.__path__, prefix=gpu.__name__ + ".")]
    return names + list(SINGLE_MODULES)


def installed_kernels() -> dict[str, object]:
    """'module:name' -> InterpretedFunction, for every @triton.jit defined in the scanned modules."""
    from triton.runtime.interpreter import InterpretedFunction

    found = {}
    for name in _modules():
        mod = importlib.import_module(name)
        for attr, value in vars(mod).items():
            if isinstance(value, InterpretedFunction) and value.fn.__module__ == name:
                found[f"{name}:{value.fn.__name__}"] = value
    return found


@pytest.fixture(scope="module")
def kernels():
    found = installed_kernels()
    assert len(found) > 30, f"only {len(found)} kernels found: is TRITON_INTERPRET=1 set before vLLM imports?"
    return found


def test_every_kernel_is_classified(kernels):
    unclassified = sorted(set(kernels) - set(KERNELS))
    gone = sorted(set(KERNELS) - set(kernels))
    assert not unclassified, f"new Triton kernels in vLLM, classify them in reachability.py: {unclassified}"
    assert not gone, f"classified kernels no longer in vLLM: {gone}"
    bad = {k: v for k, v in KERNELS.items()
           if not (v in ("native", "helper") or v.startswith("unreachable: "))}
    assert not bad, bad


def test_every_reachable_kernel_is_native_and_guard_matches(kernels):
    dispatch.load_native_modules()
    problems = {}
    for key, verdict in KERNELS.items():
        if verdict != "native":
            continue
        entry, why = dispatch.guard(kernels[key].fn, kernels[key].arg_names)
        if entry is None:
            problems[key] = why
    assert not problems, problems


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
    files = [p for p in (root / "v1" / "worker" / "gpu").rglob("*.py") if "@triton.jit" in p.read_text()]
    files += [root / "v1" / "worker" / "utils.py", root / "v1" / "sample" / "ops" / "topk_topp_triton.py"]
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts) for p in files}
    assert modules <= {k.split(":")[0] for k in kernels}
