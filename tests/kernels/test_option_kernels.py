"""Kernels that only an engine option reaches on CPU, native vs interpreter, bit-exact (they move or compare
integers and copy values): ``--enable-trace-replay`` (``_trace_replay_kernel``), ``--return-sampling-mask``
(``_compact_sampling_mask_kernel``), ``--enable-prompt-embeds`` (``_apply_prompt_embeds_kernel``) and a hybrid
model on a non-last pipeline-parallel rank (``_fill_num_accepted_kernel``)."""

from __future__ import annotations

import pytest
import torch
from diff import Launch, differential, pointer_table, run_native
from vllm.v1.worker.gpu.model_states import mamba_hybrid, prompt_embeds
from vllm.v1.worker.gpu.sample import batch_shard, output, thinking_budget, trace_replay


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
        watch = {
            "sampled": sampled,
            "idx": idx,
            "trace": trace,
            "trace_len": trace_len,
            "total": total,
            "prompt": prompt,
        }
        return Launch(grid=(n,), args=(sampled, idx, trace, trace.stride(0), trace_len, total, prompt), watch=watch)

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
        watch = {"logits": logits, "cu": cu, "num_sampled": num_sampled, "ids": ids, "packed": packed, "counts": counts}
        return Launch(
            grid=(out_rows,),
            args=(
                logits,
                logits.stride(0),
                logits.stride(1),
                cu,
                num_sampled,
                ids,
                ids.stride(0),
                packed,
                packed.stride(0),
                counts,
                vocab,
                max_kept,
            ),
            kwargs={"ROWS_PER_REQUEST": rows_per_request, "BLOCK_SIZE": block},
            watch=watch,
        )

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
        mask_ptrs = torch.tensor(
            [mk.data_ptr() if on else 0 for mk, on in zip(masks, use_mask.tolist(), strict=False)], dtype=torch.uint64
        )  # 0: no is-token-ids mask
        inputs = torch.randn(int(qsl[-1]) + 2, hidden + 3, generator=g).to(dtype)
        blocks = -(-max(int(qlen.max()), 1) // token_block)
        if seed % 3 == 2:
            blocks = max(1, blocks - 1)  # a grid short of the longest query: only its token blocks run
        watch = {"inputs": inputs, "idx": idx, "lens": lens, "computed": computed, "qsl": qsl}
        watch |= {f"embeds{i}": e for i, e in enumerate(embeds)} | {f"mask{i}": mk for i, mk in enumerate(masks)}
        return Launch(
            grid=(n, blocks),
            args=(inputs, inputs.stride(0), embeds_ptrs, mask_ptrs, lens, idx, qsl, computed, hidden),
            kwargs={"TOKEN_BLOCK": token_block, "BLOCK_SIZE": 16},
            watch=watch,
            keep=[embeds, masks],
        )

    assert differential(prompt_embeds._apply_prompt_embeds_kernel, make, range(9)) == 9
    # Not vacuous: some rows were overwritten.
    case, before = make(0), make(0).watch["inputs"]
    run_native(prompt_embeds._apply_prompt_embeds_kernel, case)
    assert not torch.equal(case.watch["inputs"], before)


# --------------------------------------------------------------------------------------------------------
# Thinking budget (a reasoning parser and thinking_token_budget): markers drawn from a 3-token alphabet so that
# they occur often, in the committed tokens and in this step's drafts.


def _thinking_world(g, m: int, L: int, lens: tuple[int, int, int]):
    start, natural, end = (_ri(g, 0, 3, (n,)) for n in lens)
    tokens = _ri(g, 0, 3, (m, L + 5))
    total = _ri(g, 0, L, (m,))
    budget = _ri(g, -1, 6, (m,))
    c_start, c_end, c_scan = _ri(g, -1, L, (m,)), _ri(g, -1, L, (m,)), _ri(g, 0, L + 3, (m,))
    cold = torch.rand(m, generator=g) < 0.4
    c_start[cold], c_end[cold], c_scan[cold] = -1, -1, 0
    return dict(
        start=start,
        natural=natural,
        end=end,
        tokens=tokens,
        total=total,
        budget=budget,
        c_start=c_start,
        c_end=c_end,
        c_scan=c_scan,
    )


@pytest.mark.parametrize("lens,block", [((1, 1, 1), 1024), ((2, 1, 3), 8), ((3, 2, 2), 4)])
def test_update_committed_marker_cache(lens, block):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        m = 7
        w = _thinking_world(g, m, 40, lens)
        req_ids = torch.randperm(m, generator=g)[: int(_ri(g, 1, m + 1))].to(torch.int32)
        args = (
            req_ids,
            w["budget"],
            w["tokens"],
            w["tokens"].stride(0),
            w["total"],
            w["c_start"],
            w["c_end"],
            w["c_scan"],
            w["start"],
            w["natural"],
        )
        return Launch(
            grid=(req_ids.numel(),),
            args=args,
            watch={**w, "req_ids": req_ids},
            kwargs={"START_LEN": lens[0], "NATURAL_END_LEN": lens[1], "MAX_LEN": max(lens[:2]), "BLOCK": block},
        )

    assert differential(thinking_budget._update_committed_marker_cache_kernel, make, range(8)) == 8


@pytest.mark.parametrize("lens", [(1, 1, 1), (2, 1, 3), (3, 2, 2)])
def test_thinking_budget(lens):
    forced = {"n": 0}

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        m, vocab = 6, 50
        w = _thinking_world(g, m, 30, lens)
        req = torch.randperm(m, generator=g)[: int(_ri(g, 1, m + 1))]
        drafts = _ri(g, 1, 4, (req.numel(),))
        mapping = req.repeat_interleave(drafts).to(torch.int32)
        local = torch.cat([torch.arange(int(d)) for d in drafts]).to(torch.int32)
        input_ids = _ri(g, 0, 3, (mapping.numel() + 1,))
        logits = torch.randn(mapping.numel(), vocab + 2, generator=g)
        w["end"] = w["end"] + 3 * torch.arange(len(w["end"]), dtype=torch.int32)  # distinct forced ids
        args = (
            logits,
            logits.stride(0),
            mapping,
            w["budget"],
            w["tokens"],
            w["tokens"].stride(0),
            w["total"],
            input_ids,
            local,
            w["c_start"],
            w["c_end"],
            w["start"],
            w["natural"],
            w["end"],
        )
        return Launch(
            grid=(mapping.numel(),),
            args=args,
            watch={**w, "logits": logits, "mapping": mapping, "local": local, "input_ids": input_ids},
            kwargs={"START_LEN": lens[0], "NATURAL_END_LEN": lens[1], "END_LEN": lens[2]},
        )

    assert differential(thinking_budget._thinking_budget_kernel, make, range(10)) == 10
    for seed in range(10):
        case = make(seed)
        run_native(thinking_budget._thinking_budget_kernel, case)
        forced["n"] += int((case.watch["logits"] == 1.0e9).sum())
    assert forced["n"] > 0  # the cases reach the forcing


# --------------------------------------------------------------------------------------------------------
# Batch-sharded sampling (tensor parallelism): the plan of one rank, and the pack / unpack around the all-gathers.


def _shard_batch(g, tp: int):
    num_reqs = int(_ri(g, 1, 9))
    idx = torch.randperm(16, generator=g)[:num_reqs].to(torch.int32)
    per_req = _ri(g, 1, 4, (num_reqs,))
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = per_req.cumsum(0)
    qlen = per_req + _ri(g, 0, 5, (num_reqs,))
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = qlen.cumsum(0)
    owners = idx.long() % tp
    per_rank = torch.bincount(owners, minlength=tp)
    logits_per_rank = torch.zeros(tp, dtype=torch.int64).index_add_(0, owners, per_req.long())
    return num_reqs, idx, cu, qsl, per_req, owners, per_rank, logits_per_rank


@pytest.mark.parametrize("tp", [2, 4])
def test_build_shard_plan(tp):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        num_reqs, idx, cu, qsl, per_req, owners, per_rank, logits_per_rank = _shard_batch(g, tp)
        rank = int(_ri(g, 0, tp))
        n_logits = int(cu[-1])
        seq_lens = _ri(g, 1, 100, (num_reqs,))
        local_n, local_logits = int(per_rank[rank]), int(logits_per_rank[rank])
        out = {
            "sorted": _ri(g, -9, 0, (n_logits,), torch.int64),
            "src": _ri(g, -9, 0, (num_reqs,), torch.int64),
            "l_idx": _ri(g, -9, 0, (local_n + 1,)),
            "l_cu": _ri(g, -9, 0, (local_n + 2,)),
            "l_logits": _ri(g, -9, 0, (local_logits + 1,), torch.int64),
            "l_exp": _ri(g, -9, 0, (local_logits + 1,)),
            "l_pos": _ri(g, -9, 0, (local_logits + 1,)),
            "l_seq": _ri(g, -9, 0, (local_n + 1,)),
        }
        args = (idx, cu, qsl, seq_lens, *out.values(), num_reqs, int(logits_per_rank[:rank].sum()), int(per_rank.max()))
        return Launch(
            grid=(num_reqs,),
            args=args,
            kwargs={"TP_SIZE": tp, "TP_RANK": rank, "PADDED_NUM_REQS": 16, "PADDED_NUM_LOGITS_PER_REQ": 4},
            watch={**out, "idx": idx, "cu": cu, "qsl": qsl, "seq": seq_lens},
        )

    assert differential(batch_shard._build_shard_plan_kernel, make, range(8)) == 8


@pytest.mark.parametrize("nans", [False, True])
def test_pack_and_unpack_sampler_output(nans):
    def make_pack(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n, mx = int(_ri(g, 1, 6)), int(_ri(g, 1, 4))
        src_cols = int(_ri(g, 1, mx + 2))
        sampled = _ri(g, 0, 1000, (n, src_cols + 1), torch.int64)
        ns, nr = _ri(g, 0, 4, (n,)), _ri(g, 0, 3, (n,))
        per = _ri(g, 1, 5, (n,))
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = per.cumsum(0)
        nan_counts = _ri(g, 0, 3, (int(cu[-1]),))
        packed = _ri(g, -9, 0, (n + 1, mx + 3), torch.int64)
        watch = {"packed": packed, "sampled": sampled, "ns": ns, "nr": nr, "cu": cu, "nan_counts": nan_counts}
        return Launch(
            grid=(n,),
            args=(
                packed,
                packed.stride(0),
                sampled,
                sampled.stride(0),
                ns,
                nr,
                nan_counts if nans else None,
                cu if nans else None,
                mx,
                min(src_cols, mx),
            ),
            kwargs={"BLOCK_SIZE": 4},
            watch=watch,
        )

    def make_unpack(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        rows, mx = int(_ri(g, 2, 8)), int(_ri(g, 1, 4))
        n = int(_ri(g, 1, rows + 1))
        gathered = _ri(g, -(2**40), 2**40, (rows, mx + 3), torch.int64)  # counts past int32: the cast wraps
        src = torch.randperm(rows, generator=g)[:n].to(torch.int64)
        out = {
            "sampled": _ri(g, -9, 0, (n * mx + 2,), torch.int64),
            "ns": _ri(g, -9, 0, (n + 1,)),
            "nr": _ri(g, -9, 0, (n + 1,)),
            "nans": _ri(g, -9, 0, (n + 1,)),
        }
        return Launch(
            grid=(n,),
            args=(
                gathered,
                gathered.stride(0),
                src,
                out["sampled"],
                out["ns"],
                out["nr"],
                out["nans"] if nans else None,
                mx,
            ),
            kwargs={"BLOCK_SIZE": 4},
            watch={**out, "gathered": gathered, "src": src},
        )

    assert differential(batch_shard._pack_sampler_output_kernel, make_pack, range(8)) == 8
    assert differential(batch_shard._unpack_gathered_output_kernel, make_unpack, range(8)) == 8


def test_pack_and_unpack_logprobs():
    def make_pack(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n, mx = int(_ri(g, 1, 5)), int(_ri(g, 1, 4))
        per = _ri(g, 0, mx + 1, (n,))
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = per.cumsum(0)
        rows = int(cu[-1]) + 1
        ncols, src_cols = int(_ri(g, 1, 6)), int(_ri(g, 1, 6))
        src_ids = _ri(g, 0, 1000, (rows, src_cols + 2), torch.int64)
        src_lp = torch.randn(rows, src_cols + 1, generator=g)
        ranks = _ri(g, 0, 50, (rows,), torch.int64)
        send_ids = _ri(g, -9, 0, (n * mx + 1, ncols + 2), torch.int64)
        send_lp = torch.randn(n * mx + 1, ncols + 1, generator=g)
        block = 1 << (ncols - 1).bit_length()
        watch = {
            "send_ids": send_ids,
            "send_lp": send_lp,
            "src_ids": src_ids,
            "src_lp": src_lp,
            "ranks": ranks,
            "cu": cu,
        }
        return Launch(
            grid=(n, mx),
            args=(
                send_ids,
                send_ids.stride(0),
                send_lp,
                send_lp.stride(0),
                src_ids,
                src_ids.stride(0),
                src_lp,
                src_lp.stride(0),
                ranks,
                cu,
                mx,
                ncols,
                src_cols,
            ),
            kwargs={"BLOCK_SIZE": block},
            watch=watch,
        )

    def make_unpack(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        n, mx, ncols = int(_ri(g, 1, 5)), int(_ri(g, 1, 4)), int(_ri(g, 1, 6))
        per = _ri(g, 0, mx + 1, (n,))
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = per.cumsum(0)
        ranks_rows = n + int(_ri(g, 0, 3))
        src = torch.randperm(ranks_rows, generator=g)[:n].to(torch.int64)
        g_ids = _ri(g, 0, 1000, (ranks_rows * mx, ncols + 2), torch.int64)
        g_lp = torch.randn(ranks_rows * mx, ncols + 1, generator=g)
        rows = int(cu[-1]) + 1
        out = {
            "ids": _ri(g, -9, 0, (rows * ncols,), torch.int64),
            "lp": torch.randn(rows * ncols, generator=g),
            "ranks": _ri(g, -9, 0, (rows,), torch.int64),
        }
        block = 1 << (ncols - 1).bit_length()
        return Launch(
            grid=(n, mx),
            args=(
                g_ids,
                g_ids.stride(0),
                g_lp,
                g_lp.stride(0),
                src,
                cu,
                out["ids"],
                out["lp"],
                out["ranks"],
                mx,
                ncols,
            ),
            kwargs={"BLOCK_SIZE": block},
            watch={**out, "g_ids": g_ids, "g_lp": g_lp, "src": src, "cu": cu},
        )

    assert differential(batch_shard._pack_logprobs_kernel, make_pack, range(8)) == 8
    assert differential(batch_shard._unpack_logprobs_kernel, make_unpack, range(8)) == 8
