"""The engine's start refuses, with exit 2 and one line, an MRV2 engine whose reachable kernels would not all run
natively (mmcpu.launch.kernels_preflight -> mmcpu.kernels.check), unless MMCPU_KERNELS=interpreter was chosen;
and vLLM told not to load our plugin. Reading the check's stamp costs milliseconds; the check itself runs only
when a file it depends on changed."""

from __future__ import annotations

import subprocess
import time

import pytest

from mmcpu import launch
from mmcpu.config import Settings, get_settings
from mmcpu.kernels import check

CXX = {"CXX": "/bin/sh"}  # any existing program stands in for a compiler: only the kernel rules are under test
PROBLEMS = [
    "vllm.v1.worker.gpu.sample.gumbel:_gumbel_sample_kernel: kernel source changed (...)",
    "vllm.v1.worker.gpu.sample.min_p:_min_p_kernel: no native implementation",
]


@pytest.fixture
def checked(monkeypatch):
    """check.cached answers PROBLEMS; records whether it was asked."""
    calls = []
    monkeypatch.setattr(check, "cached", lambda **kw: calls.append(kw) or (list(PROBLEMS), "stamp"))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return calls


def test_stale_kernels_refuse_the_start_in_one_line(checked):
    reason = launch.preflight(Settings(), CXX)
    assert reason and "\n" not in reason and len(checked) == 1
    assert reason.startswith(f"MRV2 kernel without a native version for this vLLM: {PROBLEMS[0]}")
    assert "(+1 more: python -m mmcpu.kernels check)" in reason and "MMCPU_KERNELS=interpreter" in reason


@pytest.mark.parametrize(
    "settings",
    [Settings(kernels="interpreter"), Settings(runner="v1"), Settings(triton_interpret=False)],
    ids=["interpreter", "v1", "no-interpreter"],
)
def test_no_kernel_check_when_nothing_native_is_asked_for(checked, settings):
    assert launch.preflight(settings, CXX) is None and checked == []


def test_vllm_plugins_must_include_ours(checked, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    reason = launch.preflight(Settings(kernels="interpreter"), CXX)
    assert reason and "leaves out 'mmcpu'" in reason
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,mmcpu")
    assert launch.preflight(Settings(kernels="interpreter"), CXX) is None


def test_serve_and_entrypoint_exit_2_before_starting_anything(checked, monkeypatch, capsys, tmp_path):
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    monkeypatch.setenv("CXX", CXX["CXX"])
    get_settings.cache_clear()
    try:
        assert launch.main(["--model", "/models/m"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"[mmcpu] refusing to start: MRV2 kernel without a native version for this vLLM: "
            f"{PROBLEMS[0]} (+1 more: python -m mmcpu.kernels check); MMCPU_KERNELS=interpreter runs "
            "vLLM's own kernels in Triton's interpreter instead (10-100x slower)"
        ]
        assert launch.entrypoint(["audio"]) == 2
        assert "audio: refusing to start: MRV2 kernel without" in capsys.readouterr().err
        monkeypatch.setenv("MMCPU_KERNELS", "interpreter")
        get_settings.cache_clear()
        assert launch.main(["--model", "/models/m"]) == 0  # chosen explicitly: starts
        assert len(started) == 1
    finally:
        get_settings.cache_clear()


def test_the_installed_vllm_passes_from_its_stamp_in_milliseconds(monkeypatch):
    """The real check on the venv's vLLM: the first call may run it (and stamps it); the next reads the stamp."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    problems, _ = check.cached()
    assert problems == []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the stamp was not used"))
    t0 = time.perf_counter()
    assert launch.preflight(Settings(), CXX) is None
    elapsed = time.perf_counter() - t0
    print(f"\n[kernel preflight from the stamp: {elapsed * 1e3:.1f} ms]")
    assert elapsed < 2  # generous for loaded CI machines; ~10 ms idle
