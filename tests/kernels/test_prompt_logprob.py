"""``_prompt_logprobs_token_ids_kernel``: native vs interpreter, bit-exact.

Only in-bounds cases are compared: when a prompt fills its row of ``all_token_ids`` to ``max_model_len``, the
kernel reads the last token's "next token" one past the row (the next row's first id, or past the end of the
table for the last row - garbage the caller drops). The native code reads the same next-row id, and 0 past
the end of the table, where the interpreter would read whatever memory follows.
"""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, native_entry, native_launches
from vllm.v1.worker.gpu.sample import prompt_logprob as vmod


def make_case(num_reqs: int, max_query: int, *, max_model_len: int = 4096, pad_tokens: int = 5):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_reqs + 3
        qlen = torch.randint(0, max_query + 1, (num_reqs,), generator=g, dtype=torch.int32)
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(qlen, 0)
        mapping = torch.randperm(max_reqs, generator=g)[:num_reqs].to(torch.int32)
        num_computed = torch.randint(0, max_model_len, (max_reqs,), generator=g, dtype=torch.int32)
        # Keep every read inside the row: num_computed + query_len < max_model_len.
        room = max_model_len - 1 - qlen.long()
        num_computed[mapping.long()] = (num_computed[mapping.long()].long() % (room + 1).clamp_min(1)).int()
        table = torch.randint(0, 50000, (max_reqs + 1, max_model_len + 3), generator=g, dtype=torch.int32)
        num_tokens = int(qsl[-1]) + pad_tokens  # the launcher's num_tokens includes padding
        out = torch.full((num_tokens,), -9, dtype=torch.int64)
        view = table[1:, :max_model_len]  # storage offset and padded stride must be honoured
        return Launch(
            grid=(num_reqs,),
            args=(out, qsl, mapping, num_computed, view, view.stride(0)),
            kwargs={"BLOCK_SIZE": 1024},
            watch={"out": out, "qsl": qsl, "mapping": mapping, "num_computed": num_computed, "table": table},
        )

    return make


@pytest.mark.parametrize("num_reqs,max_query", [(1, 5), (3, 40), (6, 300), (2, 2500)])
def test_prompt_logprobs_token_ids(num_reqs, max_query):
    assert differential(vmod._prompt_logprobs_token_ids_kernel, make_case(num_reqs, max_query), range(4)) == 4


def test_prompt_logprobs_token_ids_row_end():
    # A request whose query runs to the end of its row reads one element past max_model_len (here the
    # row's padding; in vLLM's unpadded table, the next row's first id).
    def make(seed: int) -> Launch:
        launch = make_case(2, 30)(seed)
        qsl, mapping, num_computed = launch.args[1], launch.args[2], launch.args[3]
        qlen = int(qsl[1] - qsl[0])
        num_computed[int(mapping[0])] = 4096 - qlen
        return launch

    assert differential(vmod._prompt_logprobs_token_ids_kernel, make, range(3)) == 3


def test_dispatch_routes_get_prompt_logprobs_token_ids():
    native_entry(vmod._prompt_logprobs_token_ids_kernel)
    launch = make_case(4, 100)(7)
    out, qsl, mapping, num_computed, table = launch.args[:5]

    def run() -> torch.Tensor:
        return vmod.get_prompt_logprobs_token_ids(int(qsl[-1]), qsl, mapping, num_computed, table)

    ref = run()
    with native_launches() as launched:
        got = run()
    assert launched["_prompt_logprobs_token_ids_kernel"] == 1
    assert torch.equal(got, ref)
