"""Kernels that only an engine option reaches on CPU, native vs interpreter, bit-exact (they move or compare
integers and copy values): ``--enable-trace-replay`` (``_trace_replay_kernel``), ``--return-sampling-mask``
(``_compact_sampling_mask_kernel``), ``--enable-prompt-embeds`` (``_apply_prompt_embeds_kernel``) and a hybrid
model on a non-last pipeline-parallel rank (``_fill_num_accepted_kernel``)."""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, pointer_table, run_native

from vllm.v1.worker.gpu.model_states import mamba_hybrid, prompt_embeds
from vllm.v1.worker.gpu.sample import output, trace_replay


def _ri(g, lo, hi, shape=(), dtype=torch.int32):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def test_fill_num_accepted():
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n, m = int(_ri(g, 1, 9)), 12
        idx = torch.randperm(m, generator=g)[:n].to(torch.int32)
        idx[torch.rand(n, generator=g) < 0.3] = -1
        acc = _ri(g, -9, 9, (m,))
        return Launch(grid=(n,), args=(idx, acc, int(_ri(g, 1, 5))), watch={"idx": idx, "acc": acc})

    assert differential(mamba_hybrid._fill_num_accepted_kernel, make, range(6)) == 6


def test_trace_replay():
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n, m, L = int(_ri(g, 1, 9)), 10, 30
        idx = torch.randperm(m, generator=g)[:n].to(torch.int32)
        idx[torch.rand(n, generator=g) < 0.2] = -1
        sampled = _ri(g, 0, 1000, (n,), torch.int64)
        trace = _ri(g, 0, 5000, (m, L + 4))[:, :L]  # a row stride that is not the trace length
        trace_len = _ri(g, -1, L, (m,))
        prompt = _ri(g, 0, 8, (m,))
        total = prompt + _ri(g, -2, L + 2, (m,))
        watch = {"sampled": sampled, "idx": idx, "trace": trace, "trace_len": trace_len, "total": total,
                 "prompt": prompt}
        return Launch(grid=(n,), args=(sampled, idx, trace, trace.stride(0), trace_len, total, prompt),
                      watch=watch)

    assert differential(trace_replay._trace_replay_kernel, make, range(8)) == 8


@pytest.mark.parametrize("rows_per_request,vocab,block", [(1, 100, 8192), (3, 1000, 256), (2, 5003, 1024)])
def test_compact_sampling_mask(rows_per_request, vocab, block):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_reqs = int(_ri(g, 1, 5))
        num_sampled = _ri(g, 0, rows_per_request + 1, (num_reqs,))
        per_req = num_sampled + _ri(g, 0, 2, (num_reqs,))  # rows the request has logits for
        cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
        cu[1:] = per_req.cumsum(0)
        rows = int(cu[-1]) + 1
        logits = torch.randn(rows, vocab, generator=g)
        logits[torch.rand(rows, vocab, generator=g) < 0.9] = float("-inf")  # a top-k / top-p support
        logits[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
        logits[torch.rand(rows, vocab, generator=g) < 0.01] = float("inf")
        if seed % 2:  # column-strided logits (the kernel takes both strides)
            logits = torch.empty(vocab, rows).t().copy_(logits)
        out_rows = num_reqs * rows_per_request
        max_kept = int(_ri(g, 1, vocab // 4))
        ids = _ri(g, -5, 5, (out_rows, max_kept + 3))
        packed = _ri(g, 0, 255, (out_rows, (vocab + 7) // 8 + 2), torch.uint8)
        counts = _ri(g, -5, 5, (out_rows,))
        watch = {"logits": logits, "cu": cu, "num_sampled": num_sampled, "ids": ids, "packed": packed,
                 "counts": counts}
        return Launch(grid=(out_rows,), args=(logits, logits.stride(0), logits.stride(1), cu, num_sampled, ids,
                                              ids.stride(0), packed, packed.stride(0), counts, vocab, max_kept),
                      kwargs={"ROWS_PER_REQUEST": rows_per_request, "BLOCK_SIZE": block}, watch=watch)

    assert differential(output._compact_sampling_mask_kernel, make, range(6)) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_prompt_embeds(dtype):
    token_block = 4
    hidden = 40

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        m = 6
        n = int(_ri(g, 1, m + 1))
        idx = torch.randperm(m, generator=g)[:n].to(torch.int32)
        lens = _ri(g, 0, 12, (m,))
        computed = _ri(g, 0, 14, (m,))
        qlen = _ri(g, 0, 10, (n,))
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        qsl[1:] = qlen.cumsum(0)
        embeds = [torch.randn(int(lens[r]) + 1, hidden, generator=g).to(dtype) for r in range(m)]
        masks = [(torch.rand(int(lens[r]) + 1, generator=g) < 0.3).to(torch.int8) for r in range(m)]
        use_mask = torch.rand(m, generator=g) < 0.5
        embeds_ptrs = pointer_table(embeds)
        mask_ptrs = torch.tensor([mk.data_ptr() if on else 0 for mk, on in zip(masks, use_mask.tolist())],
                                 dtype=torch.uint64)  # 0: no is-token-ids mask
        inputs = torch.randn(int(qsl[-1]) + 2, hidden + 3, generator=g).to(dtype)
        blocks = -(-max(int(qlen.max()), 1) // token_block)
        if seed % 3 == 2:
            blocks = max(1, blocks - 1)  # a grid short of the longest query: only its token blocks run
        watch = {"inputs": inputs, "idx": idx, "lens": lens, "computed": computed, "qsl": qsl}
        watch |= {f"embeds{i}": e for i, e in enumerate(embeds)} | {f"mask{i}": mk for i, mk in enumerate(masks)}
        return Launch(grid=(n, blocks), args=(inputs, inputs.stride(0), embeds_ptrs, mask_ptrs, lens, idx, qsl,
                                              computed, hidden),
                      kwargs={"TOKEN_BLOCK": token_block, "BLOCK_SIZE": 16}, watch=watch, keep=[embeds, masks])

    assert differential(prompt_embeds._apply_prompt_embeds_kernel, make, range(9)) == 9
    # Not vacuous: some rows were overwritten.
    case, before = make(0), make(0).watch["inputs"]
    run_native(prompt_embeds._apply_prompt_embeds_kernel, case)
    assert not torch.equal(case.watch["inputs"], before)
