"""``_apply_grammar_bitmask_kernel``: native vs interpreter, bit-exact (it only stores -inf, so bf16 runs in
the interpreter directly); and vLLM's ``StructuredOutputsWorker`` on CPU reaches the native kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from diff import Launch, differential
from vllm.v1.worker.gpu import structured_outputs as vmod

from mmcpu.config import REPO_ROOT

SHAPES = [(1, 100), (3, 1000), (6, 5003)]  # (masks, vocab)


def make_case(
    num_masks: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    *,
    block_size: int = 8192,
    duplicates: bool = False,
    extra_words: int = 0,
    mask_stride: int = 3,
):
    """Masks keyed ``request * MASK_STRIDE + position`` as ``_build_grammar_mapping`` makes them, over requests
    with 1..MASK_STRIDE logits rows (``cu_num_logits``); some positions lie past their request's rows (drafts
    trimmed on device: inactive masks). ``duplicates``: several masks for one (request, position).
    ``extra_words`` < 0: a bitmask narrower than the vocab (the kernel reads 0 = banned past its stride);
    > 0: rows wider than needed (stride > words)."""

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_reqs = num_masks + 1
        per_req = torch.randint(1, mask_stride + 1, (num_reqs,), generator=g)
        cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
        cu[1:] = per_req.cumsum(0)
        num_rows = int(cu[-1]) + 2  # rows no mask targets stay untouched
        logits = (torch.randn(num_rows, vocab + 3, generator=g) * 3).to(dtype)
        keys = torch.randperm(num_reqs * mask_stride, generator=g)[:num_masks]
        if duplicates:
            keys[num_masks // 2 :] = keys[
                torch.randint(0, max(num_masks // 2, 1), (num_masks - num_masks // 2,), generator=g)
            ]
        words = (vocab + 31) // 32 + extra_words
        bitmask = torch.randint(-(2**31), 2**31, (num_masks, words), generator=g)
        bitmask |= torch.randint(-(2**31), 2**31, (num_masks, words), generator=g)  # mostly allowed, as grammars are
        bitmask = bitmask.to(torch.int32)
        bitmask[0, : words // 3] = -1  # all allowed
        bitmask[-1, words // 2 :] = 0  # all banned
        args = (logits, logits.stride(0), keys.to(torch.int32), cu, bitmask, bitmask.stride(0), vocab)
        watch = {"logits": logits, "indices": args[2], "cu": cu, "bitmask": bitmask}
        grid = (num_masks, -(-vocab // block_size))
        return Launch(grid=grid, args=args, kwargs={"MASK_STRIDE": mask_stride, "BLOCK_SIZE": block_size}, watch=watch)

    return make


def test_cases_have_active_and_inactive_masks():
    active = inactive = 0
    for seed in range(4):
        case = make_case(6, 1000)(seed)
        keys, cu = case.watch["indices"].long(), case.watch["cu"].long()
        req, pos = keys // 3, keys % 3
        on = pos < cu[req + 1] - cu[req]
        active, inactive = active + int(on.sum()), inactive + int((~on).sum())
    assert active > 0 and inactive > 0


@pytest.mark.parametrize("num_masks,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask(num_masks, vocab, dtype):
    assert differential(vmod._apply_grammar_bitmask_kernel, make_case(num_masks, vocab, dtype), range(4)) == 4


@pytest.mark.parametrize(
    "kw",
    [{"block_size": 1024}, {"duplicates": True}, {"extra_words": 5}, {"extra_words": -3}, {"mask_stride": 1}],
    ids=["many-blocks", "duplicate-rows", "wide", "narrow", "no-drafts"],
)
def test_bitmask_edges(kw):
    assert differential(vmod._apply_grammar_bitmask_kernel, make_case(4, 5003, **kw), range(3)) == 3


# Run in a child process: the CPU worker's torch patches (vllm/v1/worker/cpu/shm.py) are process-wide.
_WORKER_SCRIPT = textwrap.dedent("""
    import json, os, types
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    import vllm.v1.worker.cpu.shm  # noqa: F401  as the CPU worker does: CUDA stream placeholders, no-op pin_memory()
    from vllm.v1.worker.gpu import structured_outputs as installed
    from mmcpu.kernels import dispatch

    vocab = 1000
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(5, vocab, generator=g)
    # Request "b" has a draft token (2 logits rows); "d" and "b" use a grammar: 3 masks for rows 4, 1, 2.
    cu = np.array([0, 1, 3, 4, 5], dtype=np.int32)
    batch = types.SimpleNamespace(req_ids=["a", "b", "c", "d"], cu_num_logits_np=cu,
                                  cu_num_logits=torch.from_numpy(cu), num_draft_tokens_per_req=None)
    bitmask = torch.randint(-2**31, 2**31, (3, (vocab + 31) // 32), generator=g).to(torch.int32).numpy()

    def apply():
        logits = logits0.clone()
        worker = installed.StructuredOutputsWorker(8, vocab, torch.device("cpu"), mask_stride=2, num_bonus_tokens=1)
        worker.apply_grammar_bitmask(logits, batch, ["d", "b"], bitmask)
        return logits

    ref = apply()  # dispatcher not installed: the interpreter
    try:
        dispatch.install("native")
        got = apply()
    finally:
        dispatch.uninstall()
    print(json.dumps({"native_launches": dispatch.STATS.native["_apply_grammar_bitmask_kernel"],
                      "equal": bool(torch.equal(ref, got)),
                      "masked_rows": sorted(set(torch.isinf(got).nonzero()[:, 0].tolist()))}))
""")


def test_worker_on_cpu():
    """vLLM's StructuredOutputsWorker on CPU (the CPU worker's torch patches; its logits-index mapping pinned only
    where pinning exists, upstream since 0.27) reaches the native kernel through the dispatcher and matches the
    interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["native_launches"] == 1 and out["equal"], out
    assert out["masked_rows"] == [1, 2, 4], out
