"""``_topk_topp_kernel`` (vllm/v1/sample/ops/topk_topp_triton.py): native vs vLLM's kernel in the interpreter.

Making the reference run: the kernel loops ``for row_id in tl.range(pid, BATCH_SIZE, num_programs)`` and then
calls ``row_id.to(tl.int64)``. Compiled Triton's loop variable is an int32 tensor; Triton's interpreter maps
``tl.range`` onto Python's ``range`` (``_patch_lang_core``), so ``row_id`` is an ``int`` and the launch dies with
``AttributeError: 'int' object has no attribute 'to'``. :mod:`mmcpu.kernels.interpreter` (the fix
``MMCPU_KERNELS=interpreter`` runs with, applied by conftest) makes the interpreter's ``tl.range`` yield int32
scalar tensors instead, during ``_topk_topp_kernel`` launches. The kernel's source runs unchanged.

The native code replays the kernel's algorithm (not exact top-p), so every comparison here is bit-exact on the
logits; ``k``, ``p`` and the tables must come back untouched. The per-program scratch ``BUFFER`` is left out:
the native code does not write it (the kernel reads only what it wrote for the same row). Large vocabularies
are too slow for the interpreter: there the sorted/bounded fast paths are checked against the native code's
literal tile-by-tile replay (``_LITERAL``), which is itself checked against the interpreter below.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, assert_same, native_launches, run_interpreter, run_native
from vllm.v1.sample.ops import topk_topp_triton as vmod

import mmcpu.kernels.topk_topp as native_mod

KERNEL = vmod._topk_topp_kernel
NINF = float("-inf")


@pytest.fixture
def native_dispatch():
    with native_launches():
        yield


def tables():
    return (
        torch.tensor(vmod._PERCENTILE_TO_STD_TABLE, dtype=torch.float32),
        torch.tensor(vmod._NORMAL_CDF_TO_SIGMA_TABLE, dtype=torch.float32),
    )


def random_logits(g: torch.Generator, batch: int, vocab: int, kind: int) -> torch.Tensor:
    """Rows of assorted shapes: Gaussian at several scales, heavy ties, peaked, near-duplicates, -inf."""
    kind %= 8
    scale = [1.0, 3.0, 0.05, 5.0, 2.0, 1.0, 2.0, 3e-6][kind]
    x = torch.randn(batch, vocab, generator=g) * scale
    if kind == 3:  # many exact ties
        x = x.round()
    if kind == 4:  # peaked: a few dominant tokens
        hot = torch.randint(0, vocab, (batch, 4), generator=g)
        x.scatter_add_(1, hot, 8 + 6 * torch.rand(batch, 4, generator=g))
    if kind == 5:  # clusters of values a few ulps apart (1e-9 "duplicates" once turned into probabilities)
        base = x[:, :1] + torch.randint(0, 4, (batch, vocab), generator=g) * 0.5
        x = torch.where(
            torch.rand(batch, vocab, generator=g) < 0.6, base + torch.randn(batch, vocab, generator=g) * 3e-7, x
        )
    if kind == 6:  # one huge negative outlier early on: the pivot searches cannot resolve the cut
        x[:, torch.randint(0, min(vocab, 256), (1,), generator=g)] = -3e4
        x = x.round(decimals=2) + torch.randint(0, 3, (batch, vocab), generator=g) * 2e-5
    if kind == 7:  # nearly uniform: probabilities an ulp apart are within 1e-9 of each other
        x += 1.0
    x[torch.rand(batch, vocab, generator=g) < 0.05] = NINF
    if batch > 2 and kind % 2:
        x[1, torch.rand(vocab, generator=g) < 0.97] = NINF  # mostly masked (grammar-like)
        x[2] = NINF  # a single finite logit
        x[2, int(torch.randint(0, vocab, (1,), generator=g))] = 1.5
    return x


def random_kp(g: torch.Generator, batch: int, vocab: int):
    k = torch.randint(1, vocab + 1, (batch,), generator=g)
    # vLLM sends 1 <= k <= vocab (k = vocab: this row has no top-k); k > vocab is treated like vocab.
    pick = torch.randint(0, 7, (batch,), generator=g)
    k = torch.where(pick == 0, 1, torch.where(pick == 1, vocab, torch.where(pick == 2, vocab - 1, k)))
    k = torch.where(pick == 3, torch.randint(1, 20, (batch,), generator=g), torch.where(pick == 4, vocab + 3, k))
    p = torch.rand(batch, generator=g).clamp_min(0.02)
    pick = torch.randint(0, 5, (batch,), generator=g)
    p = torch.where(pick == 0, 1.0, torch.where(pick == 1, 0.9, torch.where(pick == 2, 0.05, p)))
    return k.to(torch.int32), p.to(torch.float32)


def make_case(
    batch: int,
    vocab: int,
    mode: str,
    *,
    dtype=torch.float32,
    stride_pad: int = 0,
    mask_value: float = NINF,
    split_covers_ponly: bool = False,
):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        # Padded rows (stride > vocab) and an extra row past BATCH_SIZE that must stay untouched.
        full = random_logits(g, batch + 1, vocab + stride_pad, seed).to(dtype)
        logits = full[:, :vocab] if stride_pad else full
        k, p = random_kp(g, batch, vocab)
        pct, cdf = tables()
        programs = min(2, batch)  # NUM_PROGRAMS = min(num_compute_units, batch): rows share programs
        buffer = torch.zeros(programs, vocab)
        topk, topp = mode in ("k", "kp"), mode in ("p", "kp")
        args = (logits, logits.stride(0), buffer, pct, cdf, k if topk else logits, p if topp else logits)
        kwargs = dict(
            BATCH_SIZE=batch,
            MASK_VALUE=mask_value,
            VOCAB_SIZE=vocab,
            BLOCK_SIZE=256,
            BLOCK_SIZE_TRUNC=128,
            TOPK_ENABLED=topk,
            TOPP_ENABLED=topp,
            SPLIT_COVERS_PONLY=split_covers_ponly,
        )
        watch = {"logits": full, "k": k, "p": p, "pct": pct, "cdf": cdf}
        return Launch(grid=(programs,), args=args, kwargs=kwargs, watch=watch)

    return make


def three_way(make, seeds, monkeypatch):
    """Interpreter vs native (fast) vs native (literal replay), bit-exact; inputs other than logits unchanged."""
    for seed in seeds:
        ref, fast, lit = make(seed), make(seed), make(seed)
        before = {k: v.clone() for k, v in fast.watch.items() if k != "logits"}
        run_interpreter(KERNEL, ref)
        run_native(KERNEL, fast)
        with monkeypatch.context() as m:
            m.setattr(native_mod, "_LITERAL", True)
            run_native(KERNEL, lit)
        assert_same(ref.watch, fast.watch, what=f"native seed={seed}")
        assert_same(ref.watch, lit.watch, what=f"literal seed={seed}")
        assert_same(before, {k: v for k, v in fast.watch.items() if k != "logits"}, what=f"inputs seed={seed}")


def test_interpreter_needs_the_range_fix(monkeypatch):
    from triton.runtime.errors import InterpreterError

    from mmcpu.kernels import interpreter

    monkeypatch.setattr(interpreter, "TENSOR_RANGE_KERNELS", frozenset())  # the range fix off, the rest on

    launch = make_case(2, 64, "k")(0)
    with pytest.raises(InterpreterError, match="has no attribute 'to'"):
        run_interpreter(KERNEL, launch)


# (batch, vocab, seeds): the seed picks the row kind (seed % 8); the interpreter's time bounds the list.
FP32_CASES = [(1, 100, range(8)), (3, 300, range(8)), (5, 777, [5, 6, 7]), (2, 1500, [2, 4])]


@pytest.mark.parametrize("mode", ["k", "p", "kp"])
@pytest.mark.parametrize("batch,vocab,seeds", FP32_CASES, ids=[f"{b}x{v}" for b, v, _ in FP32_CASES])
def test_fp32(monkeypatch, mode, batch, vocab, seeds):
    three_way(make_case(batch, vocab, mode), seeds, monkeypatch)


def test_strided_rows(monkeypatch):
    # fp32 only: the kernel loads logits in their own dtype and its launcher admits fp32 alone.
    three_way(make_case(3, 400, "kp", stride_pad=9), range(4), monkeypatch)


@pytest.mark.parametrize("mode", ["p", "kp"])
def test_split_covers_p_only_rows(monkeypatch, mode):
    # SPLIT_COVERS_PONLY (CUDA's split top-p pipeline co-runs): with top-k on, rows whose k >= vocab skip the
    # standalone top-p pass; without top-k the flag changes nothing.
    make = make_case(4, 300, mode, split_covers_ponly=True)
    three_way(make, range(8), monkeypatch)
    if mode == "kp":  # the cases reach a skipped row: their logits differ from the flag-off launch
        differs = 0
        for seed in range(8):
            on, off = make(seed), make_case(4, 300, mode)(seed)
            run_native(KERNEL, on)
            run_native(KERNEL, off)
            differs += int(not torch.equal(on.watch["logits"], off.watch["logits"]))
        assert differs > 0


def test_mask_value(monkeypatch):
    three_way(make_case(3, 300, "kp", mask_value=-12345.678), range(3), monkeypatch)


@pytest.mark.parametrize("vocab", [32000, 51864])
def test_large_vocab_fast_paths_match_literal_replay(monkeypatch, vocab):
    for seed in range(8):
        batch = 1 + seed % 8
        mode = ["k", "p", "kp"][seed % 3]
        fast, lit = make_case(batch, vocab, mode)(seed), make_case(batch, vocab, mode)(seed)
        run_native(KERNEL, fast)
        with monkeypatch.context() as m:
            m.setattr(native_mod, "_LITERAL", True)
            run_native(KERNEL, lit)
        assert_same(lit.watch, fast.watch, what=f"vocab={vocab} seed={seed} {mode}")


def test_top_k_is_exact_with_lowest_index_ties(native_dispatch):
    # When the ternary search finds its pivot (always, unless the k-th value is not resolvable in 18 steps),
    # the kernel keeps exactly k tokens: all above the k-th value, then its copies in index order.
    g = torch.Generator().manual_seed(0)
    for vocab in (32000, 51864):
        x = torch.randn(8, vocab, generator=g) * 2
        x[4:] = x[4:].round(decimals=1)  # ties at the cut
        x[torch.rand(8, vocab, generator=g) < 0.02] = NINF
        k = torch.tensor([1, 2, 50, 1000, 7, 50, 3000, vocab - 1], dtype=torch.int32)
        got = vmod.apply_top_k_top_p_triton(x.clone(), k, None)
        for i in range(8):
            want = x[i] > NINF
            if want.sum() > k[i]:  # with no more than k finite logits the kernel masks nothing
                kth = x[i].sort(descending=True).values[k[i] - 1]
                ties = (x[i] == kth).nonzero().flatten()[: int(k[i] - (x[i] > kth).sum())]
                want = x[i] > kth
                want[ties] = True
            assert torch.equal(got[i] > NINF, want), (vocab, i)


def test_dispatch_routes_apply_top_k_top_p_triton():
    logits = torch.randn(4, 51864)
    with native_launches() as launched:
        out = vmod.apply_top_k_top_p_triton(
            logits, torch.tensor([5, 51864, 40, 1], dtype=torch.int32), torch.tensor([1.0, 0.5, 1.0, 0.3])
        )
    assert launched["_topk_topp_kernel"] == 1
    kept = (out > NINF).sum(dim=1).tolist()
    assert [kept[0], kept[2], kept[3]] == [5, 40, 1] and 1 <= kept[1] < 51864
