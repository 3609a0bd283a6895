"""``_topk_log_softmax_kernel``, ``_ranks_kernel``, ``_fill_logprob_token_ids_kernel``: native vs interpreter.

Exact: ranks, the logprob token-id table and its validity mask, and which log-softmax outputs are NaN / +-inf
(a row holding any NaN is NaN throughout; an all -inf row too).

Tolerance: the log-softmax values, within ``LOGPROB_ATOL``. The row max and the final subtractions are exact,
but ``log(sum(exp(x - max)))`` is not reproducible bit for bit: the interpreter's reference sums each
1024-wide block with numpy's pairwise summation and the blocks in sequence, with numpy's fp32 ``exp`` / ``log``
(``exp`` alone differs from torch's in the last bit for ~40 % of inputs); the native code uses torch's fp32
``exp``, ``sum`` and ``log`` over the whole row. The largest difference seen is reported by
``test_logprob_mismatch_report``.

bfloat16 logits: the interpreter cannot build bf16 constants, so bf16 is checked against the interpreter on the
fp32 upcast. Every kernel here upcasts bf16 on load or only compares bf16 values with each other, so that is
the same computation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
from diff import Launch, assert_same, differential, native_entry, native_launches, run_interpreter, run_native
from vllm.v1.worker.gpu.sample import logprob as vmod

LOGPROB_ATOL = 1e-5  # |logprob| <= ~30 here; fp32 ulp at 16-32 is 2e-6
_WORST = {"abs": 0.0}


def make_logits(g: torch.Generator, rows: int, vocab: int, *, special: bool) -> torch.Tensor:
    """[rows + 1, vocab + 6] logits (padded rows, offset view taken by callers); ``special`` adds -inf entries,
    a row with scattered NaNs, a row with a whole NaN block and an all -inf row when there are rows enough."""
    logits = torch.randn(rows + 1, vocab + 6, generator=g) * 4
    if special:
        logits[torch.rand(logits.shape, generator=g) < 0.05] = float("-inf")
        if rows >= 3:
            logits[1, torch.randint(0, vocab, (5,), generator=g)] = float("nan")
        if rows >= 4 and vocab >= 2048:
            logits[2, 1024:2048] = float("nan")
        if rows >= 5:
            logits[3, :vocab] = float("-inf")
    return logits


# --------------------------------------------------------------------------------------------------------
# _topk_log_softmax_kernel


def make_topk_case(rows: int, vocab: int, topk: int, *, special: bool = False, dtype=torch.float32):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        logits = make_logits(g, rows, vocab, special=special).to(dtype)
        # ids in a wider table: their row stride is not topk
        ids = torch.randint(0, vocab, (rows, topk + 3), generator=g, dtype=torch.int64)[:, :topk]
        out = torch.full((rows, topk), -3.0)
        view = logits[1:, :vocab]
        return Launch(
            grid=(rows,),
            args=(out, view, view.stride(0), ids, ids.stride(0), topk, vocab),
            kwargs={"BLOCK_SIZE": 1024, "TOPK_BLOCK_SIZE": min(triton.next_power_of_2(topk), 1024)},
            watch={"out": out, "logits": logits, "ids": ids},
        )

    return make


def topk_differential(make, seeds) -> None:
    for seed in seeds:
        ref, got = make(seed), make(seed)
        run_interpreter(vmod._topk_log_softmax_kernel, ref)
        run_native(vmod._topk_log_softmax_kernel, got)
        a, b = ref.watch["out"], got.watch["out"]
        # Same NaN / infinity pattern exactly; finite values within tolerance.
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        assert torch.equal(a[a.isinf()], b[b.isinf()])
        fin = a.isfinite()
        if fin.any():
            _WORST["abs"] = max(_WORST["abs"], float((a[fin] - b[fin]).abs().max()))
        assert_same(ref.watch, got.watch, what=f"seed {seed}", atol={"out": LOGPROB_ATOL})


@pytest.mark.parametrize("rows,vocab,topk", [(1, 1000, 1), (5, 5003, 6), (3, 8192, 21), (2, 51864, 9)])
def test_topk_log_softmax_fp32(rows, vocab, topk):
    topk_differential(make_topk_case(rows, vocab, topk), range(2))


@pytest.mark.parametrize("rows,vocab", [(6, 3000), (5, 2048)])
def test_topk_log_softmax_nan_inf(rows, vocab):
    topk_differential(make_topk_case(rows, vocab, 7, special=True), range(3))


def test_topk_log_softmax_wide_topk():
    # More ids than one TOPK_BLOCK_SIZE (1024): the kernel's id loop runs twice.
    topk_differential(make_topk_case(2, 3000, 1500), range(1))


def test_topk_log_softmax_bf16_matches_fp32_reference():
    make = make_topk_case(4, 5003, 5, special=True, dtype=torch.bfloat16)
    for seed in range(2):
        ref, got = make(seed), make(seed)
        full = ref.watch["logits"].float()
        ref.args = (ref.args[0], full[1:, :5003], *ref.args[2:])
        run_interpreter(vmod._topk_log_softmax_kernel, ref)
        run_native(vmod._topk_log_softmax_kernel, got)
        torch.testing.assert_close(got.watch["out"], ref.watch["out"], atol=LOGPROB_ATOL, rtol=0, equal_nan=True)
        assert_same({"logits": full.to(torch.bfloat16)}, {"logits": got.watch["logits"]}, what=f"seed {seed}")


# --------------------------------------------------------------------------------------------------------
# _ranks_kernel


def make_ranks_case(rows: int, vocab: int, *, special: bool = False, ties: bool = False, dtype=torch.float32):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        logits = make_logits(g, rows, vocab, special=special)
        if ties:
            logits = logits.round().clamp(-4, 4)
        logits = logits.to(dtype)
        token_ids = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int64)
        if special:  # some tokens whose own logit is -inf (the padded-tail quirk) or NaN
            token_ids[0] = int((logits[1, :vocab] == float("-inf")).nonzero()[0])
            if rows >= 3:
                token_ids[1] = int(logits[2, :vocab].isnan().nonzero()[0])
        ranks = torch.full((rows,), -1, dtype=torch.int64)
        view = logits[1:, :vocab]
        return Launch(
            grid=(rows,),
            args=(ranks, view, view.stride(0), token_ids, vocab),
            kwargs={"BLOCK_SIZE": 8192},
            watch={"ranks": ranks, "logits": logits, "ids": token_ids},
        )

    return make


@pytest.mark.parametrize("rows,vocab", [(1, 1000), (4, 8192), (3, 20000), (2, 51864)])
def test_ranks_fp32(rows, vocab):
    assert differential(vmod._ranks_kernel, make_ranks_case(rows, vocab, ties=True), range(2)) == 2


def test_ranks_nan_inf():
    assert differential(vmod._ranks_kernel, make_ranks_case(5, 5003, special=True), range(3)) == 3


def test_ranks_bf16_matches_fp32_reference():
    make = make_ranks_case(4, 5003, special=True, dtype=torch.bfloat16)
    for seed in range(2):
        ref, got = make(seed), make(seed)
        ref.args = (ref.args[0], ref.watch["logits"].float()[1:, :5003], *ref.args[2:])
        run_interpreter(vmod._ranks_kernel, ref)
        run_native(vmod._ranks_kernel, got)
        assert torch.equal(got.watch["ranks"], ref.watch["ranks"])


# --------------------------------------------------------------------------------------------------------
# _fill_logprob_token_ids_kernel


def make_fill_case(rows: int, num_topk: int, max_custom: int, padded_cols: int | None = None):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs, max_ids = rows + 3, 128  # MAX_LOGPROB_TOKEN_IDS
        mapping = torch.randperm(max_reqs, generator=g)[:rows].to(torch.int32)
        num_custom = torch.randint(0, max_custom + 1, (max_reqs,), generator=g, dtype=torch.int32)
        num_custom[torch.rand(max_reqs, generator=g) < 0.4] = 0
        per_req = torch.randint(0, 50000, (max_reqs, max_ids), generator=g, dtype=torch.int32)
        topk = torch.randint(0, 50000, (rows, max(num_topk, 1) + 2), generator=g, dtype=torch.int32)
        sampled = torch.randint(0, 50000, (rows,), generator=g, dtype=torch.int64)
        num_cols = max(num_topk, int(num_custom[mapping.long()].max()))
        out = torch.full((rows, 1 + num_cols + 2), -5, dtype=torch.int64)  # padded rows, sentinel values
        valid = torch.zeros((rows, 1 + num_cols + 3), dtype=torch.bool)
        topk_ptr = topk if num_topk > 0 else per_req  # the launcher's stand-in pointer when NUM_TOPK == 0
        return Launch(
            grid=(rows,),
            args=(
                out,
                out.stride(0),
                valid,
                valid.stride(0),
                sampled,
                topk_ptr,
                topk_ptr.stride(0),
                mapping,
                num_custom,
                per_req,
                per_req.stride(0),
            ),
            kwargs={"NUM_TOPK": num_topk, "PADDED_COLS": padded_cols or triton.next_power_of_2(max(num_cols, 1))},
            watch={
                "out": out,
                "valid": valid,
                "sampled": sampled,
                "topk": topk,
                "mapping": mapping,
                "num_custom": num_custom,
                "per_req": per_req,
            },
        )

    return make


@pytest.mark.parametrize("rows,num_topk,max_custom", [(1, 0, 3), (4, 5, 2), (6, 3, 12), (5, 0, 128), (3, 20, 0)])
def test_fill_logprob_token_ids(rows, num_topk, max_custom):
    assert differential(vmod._fill_logprob_token_ids_kernel, make_fill_case(rows, num_topk, max_custom), range(4)) == 4


def test_fill_logprob_token_ids_narrow_padded_cols():
    # PADDED_COLS below the widest row (not what the launcher passes): the kernel writes only PADDED_COLS.
    assert differential(vmod._fill_logprob_token_ids_kernel, make_fill_case(5, 6, 12, padded_cols=4), range(3)) == 3


def test_logprob_mismatch_report():
    print(f"\nlargest |native - interpreter| log-softmax difference: {_WORST['abs']:.3g} (atol {LOGPROB_ATOL})")
    assert _WORST["abs"] <= LOGPROB_ATOL


# --------------------------------------------------------------------------------------------------------
# Dispatch: vLLM's compute_topk_scores reaches all three native kernels


def test_dispatch_routes_compute_topk_scores():
    for k in (vmod._topk_log_softmax_kernel, vmod._ranks_kernel, vmod._fill_logprob_token_ids_kernel):
        native_entry(k)
    g = torch.Generator().manual_seed(3)
    rows, vocab, max_reqs = 3, 51864, 6
    logits = torch.randn(rows, vocab, generator=g) * 3
    sampled = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int64)
    mapping = torch.tensor([4, 0, 2], dtype=torch.int32)
    num_ids = torch.tensor([0, 0, 3, 0, 2, 0], dtype=torch.int32)
    token_ids = torch.randint(0, vocab, (max_reqs, 128), generator=g, dtype=torch.int32)
    # compute_topk_scores reads only these two tensors of a LogprobTokenIdsState.
    state = SimpleNamespace(num_token_ids=SimpleNamespace(gpu=num_ids), token_ids=SimpleNamespace(gpu=token_ids))

    def run():
        return vmod.compute_topk_scores(
            logits, 2, sampled, logprob_token_ids_state=state, expanded_idx_mapping=mapping, max_per_req_token_ids=3
        )

    ref = run()
    with native_launches() as launched:
        got = run()
    for name in ("_topk_log_softmax_kernel", "_ranks_kernel", "_fill_logprob_token_ids_kernel"):
        assert launched[name] == 1, name
    assert torch.equal(got.logprob_token_ids, ref.logprob_token_ids)
    assert torch.equal(got.selected_token_ranks, ref.selected_token_ranks)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=LOGPROB_ATOL, rtol=0)
    assert torch.equal(got.logprobs.isinf(), ref.logprobs.isinf())
