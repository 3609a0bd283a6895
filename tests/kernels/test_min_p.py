"""``_min_p_kernel``: native vs interpreter.

bfloat16 logits: Triton's interpreter cannot build bf16 constants (``'InterpreterBuilder' object has no
attribute 'get_bf16'``), so it cannot be the reference there. The kernel upcasts every load to fp32 and only
selects values (``where``), so its bf16 result is its fp32 result on the upcast input, cast back: that is the
reference used for bf16, exactly.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, bf16_matches_fp32_reference, differential
from vllm.v1.worker.gpu.sample import min_p as vmod

SHAPES = [(1, 100), (3, 1024), (8, 5003)]


def make_case(num_tokens: int, vocab: int, dtype: torch.dtype):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_tokens + 3
        # Padded rows (stride > vocab) and an untouched extra row prove the stride and row count are respected.
        logits = (torch.randn(num_tokens + 1, vocab + 7, generator=g) * 3).to(dtype)
        mapping = torch.randperm(max_reqs, generator=g)[:num_tokens].to(torch.int32)
        min_p = torch.rand(max_reqs, generator=g) * 0.5
        min_p[torch.rand(max_reqs, generator=g) < 0.3] = 0.0  # some rows disabled
        return Launch(
            grid=(num_tokens,),
            args=(logits, logits.stride(0), mapping, min_p, vocab),
            kwargs={"BLOCK_SIZE": 1024},
            watch={"logits": logits, "mapping": mapping, "min_p": min_p},
        )

    return make


@pytest.mark.parametrize("num_tokens,vocab", SHAPES)
def test_min_p_fp32(num_tokens, vocab):
    assert differential(vmod._min_p_kernel, make_case(num_tokens, vocab, torch.float32), range(6)) == 6


@pytest.mark.parametrize("num_tokens,vocab", SHAPES)
def test_min_p_bf16_matches_fp32_reference(num_tokens, vocab):
    bf16_matches_fp32_reference(vmod._min_p_kernel, make_case(num_tokens, vocab, torch.bfloat16), range(4))
