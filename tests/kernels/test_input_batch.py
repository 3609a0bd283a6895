"""``input_batch.py``'s seven kernels: native vs interpreter, bit-exact.

Every case is a random batch of request states shaped and typed as ``RequestState`` / ``InputBuffers`` hold
them (int32 bookkeeping, int64 positions / sampled / draft tokens, ``query_start_loc`` padded past the batch),
with a mix of prefilling, chunked-prefill, prompt-tail and decoding requests. Output buffers start as garbage,
so a missing or stray write shows up; every tensor of the world is compared after the launch.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_launches
from vllm.triton_utils import triton
from vllm.v1.worker.gpu import input_batch as vmod

I32, I64 = torch.int32, torch.int64


def _int(g, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _garbage(g, *shape, dtype=I32):
    return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)


def world(
    seed: int, max_reqs: int, max_model_len: int, spec: int, vocab: int = 50, num_new: int = 1, lookahead: int = 1
):
    """One batch: request states (indexed by state slot) and per-batch inputs (indexed by batch position)."""
    g = torch.Generator().manual_seed(seed)
    M, L = max_reqs, max_model_len
    n = _int(g, 1, M)
    padded = _int(g, n, M)
    idx = torch.randperm(M, generator=g)[:n].to(I32)
    prefill_len = torch.randint(1, L // 2, (M,), generator=g, dtype=I32)
    computed = torch.zeros(M, dtype=I32)
    query_lens, num_draft = torch.zeros(n, dtype=I64), torch.zeros(n, dtype=I64)
    for b in range(n):
        r, p = int(idx[b]), int(prefill_len[idx[b]])
        kind = _int(g, 0, 2)
        if kind == 0:  # (chunked) prefill: a chunk of the rest of the prompt
            computed[r] = _int(g, 0, p - 1)
            query_lens[b] = _int(g, 1, p - int(computed[r]))
        else:  # decoding (kind 2: with draft tokens) or the last prompt tokens plus drafts
            num_draft[b] = _int(g, 0, spec) if kind == 2 else 0
            computed[r] = _int(g, max(0, p - 2), L // 2)
            query_lens[b] = num_draft[b] + num_new + _int(g, 0, 1)
    num_tokens = int(query_lens.sum())
    qsl = torch.full((M + 1,), num_tokens, dtype=I32)  # prepare_inputs pads past the batch with num_tokens
    qsl[0] = 0
    qsl[1 : n + 1] = query_lens.cumsum(0)
    seq_lens_buf = _garbage(g, M)
    seq_lens_buf[:n] = computed[idx.long()] + query_lens.to(I32)
    num_logits = num_draft + num_new
    cu = torch.zeros(n + 1, dtype=I32)
    cu[1:] = num_logits.cumsum(0)
    return dict(
        g=g,
        n=n,
        padded=padded,
        idx=idx,
        prefill_len=prefill_len,
        computed=computed,
        qsl=qsl[: padded + 1],
        num_tokens=num_tokens,
        seq_lens=seq_lens_buf[:padded],
        seq_lens_buf=seq_lens_buf,
        cu=cu,
        num_draft=num_draft,
        total_logits=int(num_logits.sum()),
        all_token_ids=torch.randint(0, vocab, (M, L), generator=g, dtype=I32),
        input_ids=_garbage(g, num_tokens + 5),
        positions=_garbage(g, num_tokens + 5, dtype=I64),
        next_prefill_tokens=_garbage(g, lookahead, M),
        last_sampled=torch.randint(0, vocab, (M, 1), generator=g),
        draft_tokens=torch.randint(0, vocab, (M, spec), generator=g),
        total_len=torch.randint(0, L - spec - 1, (M,), generator=g, dtype=I32),
        bins=torch.randint(0, 3, (M, vocab), generator=g, dtype=I32),
    )


def _make(build):
    """A case factory from ``build(seed) -> (grid, args, kwargs, watch)``."""

    def make(seed: int) -> Launch:
        grid, args, kwargs, watch = build(seed)
        return Launch(grid=grid, args=args, kwargs=kwargs, watch=watch)

    return make


SHAPES = [(1, 16, 0), (4, 40, 0), (7, 64, 3)]  # max_reqs, max_model_len, speculative steps


@pytest.mark.parametrize("lookahead", [1, 3])  # next_prefill_tokens rows (num_prefill_lookahead)
@pytest.mark.parametrize("block", [1024, 4])
@pytest.mark.parametrize("M,L,S", SHAPES)
def test_prepare_prefill_inputs(M, L, S, block, lookahead):
    def build(seed):
        w = world(seed, M, L, S, lookahead=lookahead)
        nxt = w["next_prefill_tokens"]
        args = (
            w["input_ids"],
            nxt,
            nxt.stride(0),
            nxt.shape[0],
            w["idx"],
            w["qsl"],
            w["all_token_ids"],
            w["all_token_ids"].stride(0),
            w["prefill_len"],
            w["computed"],
        )
        watch = {
            k: w[k]
            for k in ("input_ids", "next_prefill_tokens", "idx", "qsl", "all_token_ids", "prefill_len", "computed")
        }
        return (w["n"],), args, {"BLOCK_SIZE": block, "LOOKAHEAD_BLOCK": triton.next_power_of_2(lookahead)}, watch

    assert differential(vmod._prepare_prefill_inputs_kernel, _make(build), range(4)) == 4


@pytest.mark.parametrize("block", [1024, 4])
@pytest.mark.parametrize("M,L,S", SHAPES)
def test_prepare_pos_seq_lens(M, L, S, block):
    def build(seed):
        w = world(seed, M, L, S)
        seq_lens = w["seq_lens_buf"]
        args = (w["positions"], seq_lens, w["idx"], w["qsl"], w["computed"], seq_lens.shape[0])
        watch = {
            "positions": w["positions"],
            "seq_lens": seq_lens,
            "idx": w["idx"],
            "qsl": w["qsl"],
            "computed": w["computed"],
        }
        return (w["n"] + 1,), args, {"BLOCK_SIZE": block}, watch

    assert differential(vmod._prepare_pos_seq_lens_kernel, _make(build), range(4)) == 4


@pytest.mark.parametrize("num_new", [1, 0])
@pytest.mark.parametrize("M,L,S", SHAPES)
def test_combine_sampled_and_draft_tokens(M, L, S, num_new):
    if S + num_new == 0:
        pytest.skip("no logits at all: the launcher's BLOCK_SIZE would be 0")

    def build(seed):
        w = world(seed, M, L, S, num_new=num_new)
        # Prefill lengths around each request's seq_len: prefill, prompt-tail and decoding requests.
        g, prefill_len = w["g"], w["prefill_len"]
        for b in range(w["n"]):
            prefill_len[w["idx"][b]] = int(w["seq_lens"][b]) + _int(w["g"], -S - 2, 1)
        logits_indices = _garbage(g, w["total_logits"] + 3, dtype=I64)[: w["total_logits"]]
        args = (
            w["input_ids"],
            w["idx"],
            w["last_sampled"],
            w["qsl"],
            w["seq_lens"],
            prefill_len,
            w["draft_tokens"],
            w["draft_tokens"].stride(0),
            w["cu"],
            logits_indices,
        )
        watch = {k: w[k] for k in ("input_ids", "idx", "last_sampled", "qsl", "seq_lens_buf", "draft_tokens", "cu")} | {
            "prefill_len": prefill_len,
            "logits_indices": logits_indices,
        }
        kwargs = {"BLOCK_SIZE": triton.next_power_of_2(S + num_new), "NUM_NEW_SAMPLED_TOKENS": num_new}
        return (w["n"],), args, kwargs, watch

    assert differential(vmod._combine_sampled_and_draft_tokens_kernel, _make(build), range(5)) == 5


@pytest.mark.parametrize("M,L,S", SHAPES)
def test_get_num_sampled_and_rejected(M, L, S):
    def build(seed):
        w = world(seed, M, L, S)
        g = w["g"]
        for b in range(w["n"]):  # some chunked prefills (seq_len < prefill_len)
            w["prefill_len"][w["idx"][b]] = int(w["seq_lens"][b]) + _int(g, -2, 2)
        num_sampled = torch.randint(0, S + 2, (w["n"],), generator=g, dtype=I32)
        num_rejected = _garbage(g, w["n"])
        args = (num_sampled, num_rejected, w["seq_lens"], w["cu"], w["idx"], w["prefill_len"])
        watch = {
            "num_sampled": num_sampled,
            "num_rejected": num_rejected,
            "seq_lens": w["seq_lens_buf"],
            "cu": w["cu"],
            "idx": w["idx"],
            "prefill_len": w["prefill_len"],
        }
        return (w["n"],), args, {}, watch

    assert differential(vmod._get_num_sampled_and_rejected_kernel, _make(build), range(5)) == 5


@pytest.mark.parametrize("with_bins,with_qsl", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("M,L,S", SHAPES)
def test_post_update(M, L, S, with_bins, with_qsl):
    def build(seed):
        w = world(seed, M, L, S, vocab=7)  # a tiny vocabulary: repeated tokens within a request
        g, n = w["g"], w["n"]
        idx = w["idx"].clone()
        idx[torch.rand(n, generator=g) < 0.25] = -1  # pipeline parallelism masks finished requests
        sampled = torch.randint(0, 7, (n, S + 1), generator=g)
        num_sampled = torch.randint(0, S + 2, (n,), generator=g, dtype=I32)
        num_rejected = torch.randint(0, S + 1, (n,), generator=g, dtype=I32)
        bins = w["bins"] if with_bins else None
        qsl = w["qsl"] if with_qsl else None
        args = (
            idx,
            w["computed"],
            w["last_sampled"],
            bins,
            bins.stride(0) if with_bins else 0,
            sampled,
            sampled.stride(0),
            num_sampled,
            num_rejected,
            qsl,
            w["all_token_ids"],
            w["all_token_ids"].stride(0),
            w["total_len"],
        )
        watch = {"idx": idx, "sampled": sampled, "num_sampled": num_sampled, "num_rejected": num_rejected}
        watch |= {k: w[k] for k in ("computed", "last_sampled", "bins", "qsl", "all_token_ids", "total_len")}
        return (n,), args, {"num_warps": 1}, watch

    assert differential(vmod._post_update_kernel, _make(build), range(5)) == 5


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("M,L,S", SHAPES)
def test_post_update_num_computed_tokens(M, L, S, repeated):
    def build(seed):
        w = world(seed, M, L, S)
        idx = w["idx"]
        if repeated:  # not from vLLM, but the kernel's sequential sum must hold for a repeated slot too
            idx = torch.randint(0, M, (w["n"],), generator=w["g"], dtype=I32)
        watch = {"idx": idx, "computed": w["computed"], "qsl": w["qsl"]}
        return (w["n"],), (idx, w["computed"], w["qsl"]), {}, watch

    assert differential(vmod._post_update_num_computed_tokens_kernel, _make(build), range(4)) == 4


@pytest.mark.parametrize("M,L,S", SHAPES)
def test_expand_idx_mapping(M, L, S):
    def build(seed):
        w = world(seed, M, L, S)
        g, total = w["g"], w["total_logits"]
        expanded = _garbage(g, total)
        local_pos = _garbage(g, total)
        args = (w["idx"], expanded, local_pos, w["cu"])
        watch = {"idx": w["idx"], "expanded": expanded, "local_pos": local_pos, "cu": w["cu"]}
        return (w["n"],), args, {"BLOCK_SIZE": triton.next_power_of_2(S + 1)}, watch

    assert differential(vmod._expand_idx_mapping_kernel, _make(build), range(4)) == 4


def _step(seed: int) -> dict[str, torch.Tensor]:
    """One model-runner step through vLLM's own launchers, in the order prepare_inputs / sample / postprocess
    call them (speculative decoding on, so every launcher runs)."""
    w = world(seed, 6, 48, 2, lookahead=2)
    n = w["n"]
    expanded, local_pos = vmod.expand_idx_mapping(w["idx"], w["total_logits"], w["cu"], 3)
    vmod.prepare_prefill_inputs(
        w["input_ids"],
        w["next_prefill_tokens"],
        w["idx"],
        w["qsl"],
        w["all_token_ids"],
        w["prefill_len"],
        w["computed"],
    )
    vmod.prepare_pos_seq_lens(w["idx"], w["qsl"], w["computed"], w["positions"], w["seq_lens_buf"])
    logits_indices = vmod.combine_sampled_and_draft_tokens(
        w["input_ids"],
        w["idx"],
        w["last_sampled"],
        w["qsl"],
        w["seq_lens"],
        w["prefill_len"],
        w["draft_tokens"],
        w["cu"],
        w["total_logits"],
    )
    num_sampled, num_rejected = vmod.get_num_sampled_and_rejected(
        torch.ones(n, dtype=I32), w["seq_lens"], w["cu"], w["idx"], w["prefill_len"]
    )
    sampled = torch.randint(0, 50, (n, 3), generator=w["g"])
    vmod.post_update(
        w["idx"],
        w["computed"],
        w["last_sampled"],
        w["bins"],
        sampled,
        num_sampled,
        num_rejected,
        w["qsl"],
        w["all_token_ids"],
        w["total_len"],
    )
    vmod.post_update_num_computed_tokens(w["idx"], w["computed"], w["qsl"])
    out = {k: v for k, v in w.items() if isinstance(v, torch.Tensor) and k != "g"}
    return out | {
        "expanded": expanded,
        "local_pos": local_pos,
        "logits_indices": logits_indices,
        "num_sampled": num_sampled,
        "num_rejected": num_rejected,
    }


def test_dispatch_routes_input_batch_launchers():
    names = (
        "_prepare_prefill_inputs_kernel",
        "_prepare_pos_seq_lens_kernel",
        "_combine_sampled_and_draft_tokens_kernel",
        "_get_num_sampled_and_rejected_kernel",
        "_post_update_kernel",
        "_post_update_num_computed_tokens_kernel",
        "_expand_idx_mapping_kernel",
    )
    for seed in range(2):
        ref = _step(seed)  # plain interpreter
        with native_launches() as launched:
            got = _step(seed)
        grew = {k: launched[k] for k in names}
        # Each launcher launches once (the runner, not prepare_prefill_inputs, skips it without prefills).
        assert all(v == 1 for v in grew.values()), grew
        for k in ref:
            assert torch.equal(ref[k], got[k]), k
