"""``_penalties_kernel`` and ``_bincount_kernel``: native vs interpreter, bit-exact.

The native penalties code performs the kernel's float32 operations one by one in the same order
(``x * (1/scale)`` or ``x * scale``, then ``x - freq * count``, then ``x - pres * seen``), so fp32 results are
identical. bfloat16 logits: the interpreter runs them but rounds fp32 -> bf16 by truncation
(``_convert_float`` with no rounding mode), while compiled Triton - and torch - round to nearest even; the
kernel upcasts on load and rounds once on store, so its bf16 result is its fp32 result on the upcast input,
rounded to nearest: that is the reference used, exactly. (Direct bf16 runs differ in the last bit only.)
"""

from __future__ import annotations

import pytest
import torch
from diff import (
    Launch,
    assert_same,
    bf16_matches_fp32_reference,
    differential,
    native_launches,
    run_interpreter,
    run_native,
)
from vllm.v1.worker.gpu.sample import penalties as vmod

SHAPES = [(1, 100), (4, 1000), (7, 5003)]  # (requests, vocab)


def _requests(g: torch.Generator, num_reqs: int, max_reqs: int, spec: bool):
    """Expanded mapping / local positions: each request 1 token, or 1..3 (draft tokens) if ``spec``."""
    req_ids = torch.randperm(max_reqs, generator=g)[:num_reqs]
    per_req = torch.randint(1, 4, (num_reqs,), generator=g) if spec else torch.ones(num_reqs, dtype=torch.long)
    mapping = req_ids.repeat_interleave(per_req).to(torch.int32)
    local_pos = torch.cat([torch.arange(int(n)) for n in per_req]).to(torch.int32)
    return mapping, local_pos


def make_penalties_case(num_reqs: int, vocab: int, dtype: torch.dtype, *, spec: bool = False, block_size: int = 8192):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_reqs + 3
        mapping, local_pos = _requests(g, num_reqs, max_reqs, spec)
        num_tokens = mapping.numel()
        # Padded rows (stride > vocab) and an extra row prove the stride and row count are respected.
        logits = (torch.randn(num_tokens + 1, vocab + 5, generator=g) * 3).to(dtype)
        logits[:, :7] = 0.0  # logit == 0 takes the "multiply" branch
        token_ids = torch.randint(0, vocab, (num_tokens,), generator=g, dtype=torch.int32)
        on = lambda p: torch.rand(max_reqs, generator=g) < p  # noqa: E731
        rep = torch.where(on(0.6), torch.rand(max_reqs, generator=g) * 1.5 + 0.5, 1.0)
        freq = torch.where(on(0.5), torch.rand(max_reqs, generator=g) * 2 - 1, 0.0)
        pres = torch.where(on(0.5), torch.rand(max_reqs, generator=g) * 2 - 1, 0.0)
        if seed % 3 == 0:  # one row without any penalty
            rep[mapping[0]], freq[mapping[0]], pres[mapping[0]] = 1.0, 0.0, 0.0
        words = (vocab + 31) // 32
        prompt_bin_mask = torch.randint(-(2**31), 2**31, (max_reqs, words), generator=g, dtype=torch.int64)
        prompt_bin_mask = (prompt_bin_mask & torch.randint(-(2**31), 2**31, (max_reqs, words), generator=g)).to(
            torch.int32
        )
        counts = torch.randint(0, 4, (max_reqs, vocab), generator=g, dtype=torch.int32)
        counts[torch.rand(max_reqs, vocab, generator=g) < 0.8] = 0
        grid = (num_tokens, -(-vocab // block_size))
        args = (
            logits,
            logits.stride(0),
            mapping,
            token_ids,
            local_pos,
            rep,
            freq,
            pres,
            prompt_bin_mask,
            prompt_bin_mask.stride(0),
            counts,
            counts.stride(0),
            vocab,
        )
        watch = {
            "logits": logits,
            "mapping": mapping,
            "token_ids": token_ids,
            "local_pos": local_pos,
            "rep": rep,
            "freq": freq,
            "pres": pres,
            "prompt_bin_mask": prompt_bin_mask,
            "counts": counts,
        }
        return Launch(grid=grid, args=args, kwargs={"BLOCK_SIZE": block_size}, watch=watch)

    return make


@pytest.mark.parametrize("num_reqs,vocab", SHAPES)
@pytest.mark.parametrize("spec", [False, True])
def test_penalties_fp32(num_reqs, vocab, spec):
    make = make_penalties_case(num_reqs, vocab, torch.float32, spec=spec)
    assert differential(vmod._penalties_kernel, make, range(4)) == 4


def test_penalties_fp32_many_blocks():
    make = make_penalties_case(3, 5003, torch.float32, spec=True, block_size=1024)
    assert differential(vmod._penalties_kernel, make, range(3)) == 3


def test_penalties_signed_zero():
    """Penalties of -0.0 count as off (``!= 0.0``) but still turn -0.0 logits into +0.0 in ``x - p * n``.
    Compared bit for bit here: ``assert_same`` compares values, and -0.0 == +0.0."""
    make = make_penalties_case(4, 1000, torch.float32, spec=True)

    def signed(seed: int) -> Launch:
        case = make(seed)
        logits, freq, pres = case.args[0], case.args[6], case.args[7]
        logits[:, 7:40] = -0.0
        freq.zero_()[::2] = -0.0
        pres.zero_()[1::2] = -0.0 if seed % 2 else 0.0
        return case

    for seed in range(4):
        ref, got = signed(seed), signed(seed)
        run_interpreter(vmod._penalties_kernel, ref)
        run_native(vmod._penalties_kernel, got)
        assert torch.equal(ref.args[0].view(torch.int32), got.args[0].view(torch.int32)), f"seed {seed}"


def test_penalties_fp16():
    """float16 logits run in the interpreter directly (numpy float16 rounds to nearest, like compiled Triton)."""
    make = make_penalties_case(4, 1000, torch.float16, spec=True)
    assert differential(vmod._penalties_kernel, make, range(3)) == 3


@pytest.mark.parametrize("num_reqs,vocab", SHAPES[1:])
def test_penalties_bf16_matches_fp32_reference(num_reqs, vocab):
    bf16_matches_fp32_reference(
        vmod._penalties_kernel, make_penalties_case(num_reqs, vocab, torch.bfloat16, spec=True), range(3)
    )


def make_bincount_case(
    num_reqs: int, vocab: int, *, block_size: int = 1024, max_len: int = 3000, odd_lengths: bool = False
):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_reqs + 3
        all_token_ids = torch.randint(0, vocab, (max_reqs, max_len), generator=g, dtype=torch.int32)
        prompt_len = torch.randint(0, max_len // 2, (max_reqs,), generator=g, dtype=torch.int32)
        extra = torch.randint(0, max_len // 2, (max_reqs,), generator=g, dtype=torch.int32)
        extra[torch.rand(max_reqs, generator=g) < 0.4] = 0  # usually prefill_len == prompt_len
        prefill_len = prompt_len + extra
        if odd_lengths:  # outside vLLM's invariant (prefill >= prompt); the kernel's block rule still decides
            prefill_len = torch.randint(0, max_len // 2, (max_reqs,), generator=g, dtype=torch.int32)
        mapping = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
        # The launcher zeroes the rows first; start from noise so OR / add (not overwrite) is checked.
        prompt_bin_mask = torch.randint(-(2**31), 2**31, (max_reqs, (vocab + 31) // 32), generator=g).to(torch.int32)
        prompt_bin_mask[torch.rand(prompt_bin_mask.shape, generator=g) < 0.7] = 0
        counts = torch.randint(0, 3, (max_reqs, vocab), generator=g, dtype=torch.int32)
        max_prefill = int(prefill_len[mapping.long()].max())
        grid = (num_reqs, -(-max_prefill // block_size))
        args = (
            mapping,
            all_token_ids,
            all_token_ids.stride(0),
            prompt_len,
            prefill_len,
            prompt_bin_mask,
            prompt_bin_mask.stride(0),
            counts,
            counts.stride(0),
        )
        watch = {
            "mapping": mapping,
            "all_token_ids": all_token_ids,
            "prompt_len": prompt_len,
            "prefill_len": prefill_len,
            "prompt_bin_mask": prompt_bin_mask,
            "counts": counts,
        }
        return Launch(grid=grid, args=args, kwargs={"BLOCK_SIZE": block_size}, watch=watch)

    return make


@pytest.mark.parametrize("num_reqs,vocab", SHAPES)
def test_bincount(num_reqs, vocab):
    assert differential(vmod._bincount_kernel, make_bincount_case(num_reqs, vocab), range(4)) == 4


def test_bincount_block_rule_outside_invariant():
    make = make_bincount_case(5, 1000, block_size=128, max_len=600, odd_lengths=True)
    assert differential(vmod._bincount_kernel, make, range(4)) == 4


def test_dispatch_routes_launchers_to_native():
    """vLLM's own ``bincount`` / ``apply_penalties`` wrappers reach the native code and match the interpreter."""
    bc_ref, bc_got = make_bincount_case(3, 1000)(7), make_bincount_case(3, 1000)(7)
    pen_ref, pen_got = (make_penalties_case(3, 1000, torch.float32, spec=True)(s) for s in (7, 7))

    def call(bc: Launch, pen: Launch) -> None:
        m, tok, _, pl, fl, pbm, _, cnt, _ = bc.args
        vmod.bincount(m, tok, pl, fl, pbm, cnt, int(fl[m.long()].max()))
        logits, _, m, ids, lp, rep, freq, pres, pbm, _, cnt, _, vocab = pen.args
        vmod.apply_penalties(logits[: m.numel(), :vocab], m, ids, lp, rep, freq, pres, pbm, cnt)

    call(bc_ref, pen_ref)  # dispatcher not installed: the interpreter
    with native_launches() as launched:
        call(bc_got, pen_got)
    for name in ("_bincount_kernel", "_penalties_kernel"):
        assert launched[name] == 1, name
    assert_same(bc_ref.watch, bc_got.watch, what="bincount via launcher")
    assert_same(pen_ref.watch, pen_got.watch, what="apply_penalties via launcher")
