"""AMX tile permission (patches/0029): vLLM's CPU attention asks Linux for AMX tile data before it picks its
AMX kernel. Without the request the kernel dies of SIGILL in a process where no oneDNN AMX kernel ran first, as a
bf16 engine's first request (a one-token text completion) did on an Intel Xeon with AMX."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mmcpu import attention as A
from mmcpu import cpu
from mmcpu.config import REPO_ROOT

cpu_attn_backend = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


@pytest.mark.skipif(cpu.current().isa != "amx", reason="needs a CPU with AMX tiles (amx_tile, amx_bf16)")
@pytest.mark.skipif(not A.has_impl("cpu_attn"), reason="this vLLM's _C has no cpu_attention_with_kv_cache")
def test_first_bf16_attention_of_a_fresh_process_runs_on_amx():
    """A fresh interpreter whose first AMX work is vLLM's paged attention in bf16 (nothing of oneDNN ran):
    it takes the amx ISA and matches the float32 reference, instead of dying of SIGILL (exit -4)."""
    code = textwrap.dedent("""
        import torch
        from mmcpu import attention as A
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 300, 6, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        isa = A._cpu_attn_isa(torch.bfloat16, 64)
        out = A.cpu_attn(q, k, v, 0.125).float()
        err = (out - A.reference(q, k, v, 0.125).float()).abs().max().item()
        tol = A.tolerance(torch.bfloat16, v.float().abs().max().item())
        print(isa, err <= tol, err, tol)
    """)
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )
    assert res.returncode == 0, f"exit {res.returncode} (-4 = SIGILL): {res.stderr[-2000:]}"
    isa, ok, *_ = res.stdout.split()[-4:]
    assert (isa, ok) == ("amx", "True"), res.stdout


@pytest.mark.parametrize("granted", [True, False])
def test_amx_isa_only_once_the_kernel_grants_tile_data(monkeypatch, granted):
    """On a CPU with AMX tiles, bf16 takes "amx" only if the request is granted; refused (a kernel without
    ARCH_REQ_XCOMP_PERM), the next ISA, as on a CPU without AMX. float32 never asks."""
    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or granted)
    isa = cpu_attn_backend._get_attn_isa(torch.bfloat16, 128, 64)
    assert (isa == "amx") is granted and asked
    asked.clear()
    assert cpu_attn_backend._get_attn_isa(torch.float32, 128, 64) != "amx" and not asked
