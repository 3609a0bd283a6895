"""``_bad_words_kernel``: native vs interpreter, bit-exact (it only stores -inf).

Bad-word prefixes are drawn from a 3-token alphabet and some are planted from the real context, so that
matches through output tokens, through draft (spec) inputs and across both happen often. Words are non-empty,
as vLLM tokenizes them; an empty word would make the kernel read before its table.
"""

from __future__ import annotations

import pytest
import torch
import vllm.envs as envs
from diff import Launch, assert_same, differential, native_launches, run_native
from vllm.v1.worker.gpu.sample import bad_words as vmod

SHAPES = [(1, 100), (4, 1000), (6, 5003)]  # (requests, vocab)
MAX_LEN = 64


def make_case(num_reqs: int, vocab: int, dtype: torch.dtype = torch.float32, *, spec: bool = True):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_reqs + 3
        ri = lambda lo, hi, shape=(): torch.randint(lo, hi, shape, generator=g)  # noqa: E731
        req_ids = torch.randperm(max_reqs, generator=g)[:num_reqs]
        per_req = ri(1, 4, (num_reqs,)) if spec else torch.ones(num_reqs, dtype=torch.long)
        mapping = req_ids.repeat_interleave(per_req).to(torch.int32)
        local_pos = torch.cat([torch.arange(int(n)) for n in per_req]).to(torch.int32)
        num_tokens = mapping.numel()
        input_ids = ri(0, 3, (num_tokens,)).to(torch.int32)

        prompt_len = ri(0, 10, (max_reqs,)).to(torch.int32)
        total_len = (prompt_len + ri(0, 20, (max_reqs,))).to(torch.int32)
        all_token_ids = ri(0, 3, (max_reqs, MAX_LEN)).to(torch.int32)

        word_tokens = torch.zeros(max_reqs, envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, dtype=torch.int32)
        offsets = torch.zeros(max_reqs, envs.VLLM_MAX_NUM_BAD_WORDS + 1, dtype=torch.int32)
        num_words = torch.zeros(max_reqs, dtype=torch.int32)
        for r in range(max_reqs):
            if torch.rand((), generator=g) < 0.25:
                continue  # no bad words for this request
            flat, offs = [], [0]
            out = all_token_ids[r, int(prompt_len[r]) : int(total_len[r])].tolist()
            for _ in range(int(ri(1, 8))):
                n = int(ri(1, 5))
                if out and torch.rand((), generator=g) < 0.3:  # plant the output's tail as the prefix
                    prefix = out[-(n - 1) :] if n > 1 else []
                else:
                    prefix = ri(0, 3, (n - 1,)).tolist()
                flat += prefix + [int(ri(0, vocab))]
                offs.append(len(flat))
            word_tokens[r, : len(flat)] = torch.tensor(flat, dtype=torch.int32)
            offsets[r, : len(offs)] = torch.tensor(offs, dtype=torch.int32)
            num_words[r] = len(offs) - 1
        max_words = max(int(num_words[mapping.long()].max()), 1)

        logits = (torch.randn(num_tokens + 1, vocab + 3, generator=g) * 3).to(dtype)
        args = (
            logits,
            logits.stride(0),
            mapping,
            word_tokens,
            word_tokens.stride(0),
            offsets,
            offsets.stride(0),
            num_words,
            all_token_ids,
            all_token_ids.stride(0),
            prompt_len,
            total_len,
            input_ids,
            local_pos,
        )
        watch = {
            "logits": logits,
            "mapping": mapping,
            "word_tokens": word_tokens,
            "offsets": offsets,
            "num_words": num_words,
            "all_token_ids": all_token_ids,
            "prompt_len": prompt_len,
            "total_len": total_len,
            "input_ids": input_ids,
            "local_pos": local_pos,
        }
        return Launch(grid=(num_tokens, max_words), args=args, watch=watch)

    return make


@pytest.mark.parametrize("num_reqs,vocab", SHAPES)
@pytest.mark.parametrize("spec", [False, True])
def test_bad_words_fp32(num_reqs, vocab, spec):
    assert differential(vmod._bad_words_kernel, make_case(num_reqs, vocab, spec=spec), range(5)) == 5


def test_bad_words_matches_happen():
    """The cases are not vacuous: some rows get a -inf."""
    hits = 0
    for seed in range(5):
        case = make_case(6, 1000)(seed)
        run_native(vmod._bad_words_kernel, case)
        hits += int(case.watch["logits"].isinf().sum())
    assert hits > 5


def test_bad_words_bf16():
    """bf16 logits: the kernel only stores -inf (no bf16 constant is built), so the interpreter runs them."""
    assert differential(vmod._bad_words_kernel, make_case(4, 1000, torch.bfloat16), range(3)) == 3


def test_dispatch_routes_launcher_to_native():
    """vLLM's ``apply_bad_words`` reaches the native code and matches the interpreter."""
    ref, got = make_case(4, 1000)(3), make_case(4, 1000)(3)

    def call(c: Launch) -> None:
        logits, _, m, wt, _, off, _, nw, at, _, pl, tl_, ii, lp = c.args
        vmod.apply_bad_words(logits[: m.numel()], m, wt, off, nw, at, pl, tl_, ii, lp, c.grid[1])

    call(ref)
    with native_launches() as launched:
        call(got)
    assert launched["_bad_words_kernel"] == 1
    assert_same(ref.watch, got.watch, what="apply_bad_words via launcher")
