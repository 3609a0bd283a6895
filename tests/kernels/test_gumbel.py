"""``_temperature_kernel`` and ``_gumbel_sample_kernel``: native vs interpreter.

Exact: Philox (``tl.randint`` / ``tl.randint4x``) and the uniforms built from it (``tl.rand``, ``tl_rand32``,
``tl_rand64``) bit for bit; temperature scaling; greedy rows (temperature 0 and invalid ``req_state_idx < 0``
rows), every processed-logits store, and every sampled token (the launcher's reduction of the per-block
outputs).

Tolerance, where the noise goes through ``log``: the interpreter's reference computes ``log`` / ``log1p`` with
numpy, the native code with torch; the two disagree in the last bit of fp32 ``-log(-log1p(-u))`` for about a
third of all draws (numpy's fp32 ``log`` is the less accurate one: ~20 % of its results are not correctly
rounded, torch's ~0.05 %). So for seeded rows the per-block max is checked within ``FP32_NOISE_ATOL``
(fp64 noise: ``FP64_NOISE_ATOL``), and the per-block argmax may in principle differ where a block's two best
candidates lie within an ulp; such blocks are counted (``_MISMATCHES``) and must stay rare, while the sampled
tokens must match on every case. With the seeds below no mismatch occurs.

bfloat16 logits: the interpreter cannot build bf16 constants (the kernels' ``other=-inf`` loads), so bf16 is
checked against the interpreter on the fp32 upcast; both kernels upcast on load, so that is exact.
"""

from __future__ import annotations

import time

import pytest
import torch
import triton
import triton.language as tl
from diff import Launch, assert_same, differential, native_entry, native_launches, run_interpreter, run_native

from mmcpu.kernels.sample import gumbel as ngumbel
from vllm.v1.worker.gpu.sample import gumbel as vmod

FP32_NOISE_ATOL = 1e-5  # ulp(fp32) at |x| ~ 30 is ~2e-6
FP64_NOISE_ATOL = 1e-12
BLOCK = 1024
_MISMATCHES: dict[str, int] = {"blocks": 0, "argmax": 0}

# --------------------------------------------------------------------------------------------------------
# Philox stream


@triton.jit
def _probe_kernel(seed_ptr, pos_ptr, gs_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, u_ptr, u32_ptr, u64_ptr, n,
                  B: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    gs = tl.randint(tl.load(seed_ptr + t), tl.load(pos_ptr + t))
    tl.store(gs_ptr + t, gs)
    block = tl.program_id(1) * B + tl.arange(0, B)
    m = block < n
    w0, w1, w2, w3 = tl.randint4x(gs, block)
    tl.store(w0_ptr + t * n + block, w0, mask=m)
    tl.store(w1_ptr + t * n + block, w1, mask=m)
    tl.store(w2_ptr + t * n + block, w2, mask=m)
    tl.store(w3_ptr + t * n + block, w3, mask=m)
    tl.store(u_ptr + t * n + block, tl.rand(gs, block), mask=m)
    tl.store(u32_ptr + t * n + block, vmod.tl_rand32(gs, block, includes_zero=False), mask=m)
    tl.store(u64_ptr + t * n + block, vmod.tl_rand64(gs, block, includes_zero=False), mask=m)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_philox_bit_exact(pos_dtype):
    n, rows = 3000, 6
    g = torch.Generator().manual_seed(11)
    seed = torch.cat([torch.tensor([0, -1, 2**63 - 1, -2**63], dtype=torch.int64),
                      torch.randint(-2**63, 2**63 - 1, (rows - 4,), generator=g, dtype=torch.int64)])
    if pos_dtype == torch.int64:  # offsets past 2**32 use the hi counter; negative ones wrap
        pos = torch.tensor([0, 1, 2**32 + 5, -1, 2**40 + 123, 77], dtype=torch.int64)
    else:
        pos = torch.tensor([0, 1, 2**31 - 1, -1, -2**31, 77], dtype=torch.int32)
    out = {k: torch.zeros(rows, n, dtype=torch.int64) for k in ("w0", "w1", "w2", "w3")}
    gs = torch.zeros(rows, dtype=torch.int64)
    u, u32, u64 = torch.zeros(rows, n), torch.zeros(rows, n), torch.zeros(rows, n, dtype=torch.float64)
    _probe_kernel[(rows, triton.cdiv(n, BLOCK))](seed, pos, gs, *out.values(), u, u32, u64, n, B=BLOCK)

    got_gs = ngumbel.randint(seed, pos, pos.element_size() * 8)
    assert torch.equal(got_gs, gs)
    offsets = torch.arange(n).unsqueeze(0)
    words = ngumbel.randint4x(got_gs.unsqueeze(1), offsets, 32)
    for i, w in enumerate(words):
        assert torch.equal(w, out[f"w{i}"]), f"word {i}"
    assert torch.equal(ngumbel.rand(got_gs.unsqueeze(1), offsets, 32), u)
    assert torch.equal(torch.maximum(u, ngumbel._FP32_TINY_RAND), u32)
    # tl_rand64, as the native noise builds it: (w1 << 32 | w0) * 2**-64
    got64 = (words[1].double() * 2.0**32 + words[0].double()) * 2.0**-64
    assert torch.equal(got64.clamp_min(2.2250738585072014e-308), u64)


# --------------------------------------------------------------------------------------------------------
# _temperature_kernel


def make_temperature_case(num_tokens: int, vocab: int, dtype: torch.dtype):
    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_tokens + 3
        logits = (torch.randn(num_tokens + 1, vocab + 5, generator=g) * 4).to(dtype)
        mapping = torch.randperm(max_reqs, generator=g)[:num_tokens].to(torch.int32)
        temp = torch.rand(max_reqs, generator=g) * 2
        pick = torch.rand(max_reqs, generator=g)
        temp[pick < 0.25] = 0.0
        temp[(pick >= 0.25) & (pick < 0.5)] = 1.0
        view = logits[1:]  # storage offset and row padding must be honoured
        return Launch(grid=(num_tokens, triton.cdiv(vocab, 8192)),
                      args=(view, view.stride(0), mapping, temp, vocab), kwargs={"BLOCK_SIZE": 8192},
                      watch={"logits": logits, "mapping": mapping, "temp": temp})

    return make


@pytest.mark.parametrize("num_tokens,vocab", [(1, 1000), (4, 5003), (3, 51864), (2, 20000)])
def test_temperature_fp32(num_tokens, vocab):
    assert differential(vmod._temperature_kernel, make_temperature_case(num_tokens, vocab, torch.float32),
                        range(3)) == 3


@pytest.mark.parametrize("num_tokens,vocab", [(3, 1000), (2, 51864)])
def test_temperature_bf16_matches_fp32_reference(num_tokens, vocab):
    make = make_temperature_case(num_tokens, vocab, torch.bfloat16)
    for seed in range(2):
        got, ref = make(seed), make(seed)
        full = ref.watch["logits"].float()
        ref.args = (full[1:], *ref.args[1:])
        run_interpreter(vmod._temperature_kernel, ref)
        run_native(vmod._temperature_kernel, got)
        assert_same({"logits": full.to(torch.bfloat16)}, {"logits": got.watch["logits"]}, what=f"seed {seed}")


# --------------------------------------------------------------------------------------------------------
# _gumbel_sample_kernel


def make_gumbel_case(num_tokens: int, vocab: int, *, temps: str = "mixed", use_fp64: bool = False,
                     apply_temperature: bool = False, processed: str | None = None, invalid: bool = False,
                     ties: bool = False, nans: bool = False, dtype: torch.dtype = torch.float32):
    """A launch as ``gumbel_sample`` makes it; ``processed``: None, "plain" (no col), "col" (one 0-d col),
    "per_token" (a col per token, tokens of one request sharing its row as in spec decoding)."""
    num_blocks = triton.cdiv(vocab, BLOCK)

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_tokens + 4
        logits = torch.randn(num_tokens + 1, vocab + 9, generator=g) * 3
        if ties:  # many equal maxima: the first index of a block's max must win
            logits = logits.round().clamp(-3, 2)
        if nans:  # a NaN wins its block (first NaN's index), as numpy's and torch's max both have it
            logits[1 + num_tokens // 2, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
        logits = logits.to(dtype)
        if processed == "per_token":
            mapping = torch.randint(0, max_reqs, (num_tokens,), generator=g, dtype=torch.int32)
        else:
            mapping = torch.randperm(max_reqs, generator=g)[:num_tokens].to(torch.int32)
        if invalid:
            mapping[torch.rand(num_tokens, generator=g) < 0.3] = -1
        temp = torch.rand(max_reqs, generator=g) * 1.5 + 0.05
        if temps == "greedy":
            temp.zero_()
        elif temps == "mixed":
            pick = torch.rand(max_reqs, generator=g)
            temp[pick < 0.3] = 0.0
            temp[(pick >= 0.3) & (pick < 0.55)] = 1.0
        seeds = torch.randint(-2**63, 2**63 - 1, (max_reqs,), generator=g, dtype=torch.int64)
        pos = torch.randint(0, 4096, (num_tokens,), generator=g, dtype=torch.int64)
        # Sentinels in the outputs: every element the kernel writes, and only those, must match.
        local_argmax = torch.full((num_tokens, num_blocks + 2), -7, dtype=torch.int64)
        local_max = torch.full((num_tokens, num_blocks + 2), -7.0,
                               dtype=torch.float64 if use_fp64 else torch.float32)
        out = col = None
        per_token = False
        if processed == "plain":
            out = torch.full((max_reqs, vocab + 3), 5.0)
        elif processed in ("col", "per_token"):
            n_steps = 3
            out = torch.full((max_reqs, n_steps, vocab), 5.0)
            if processed == "col":
                col = torch.tensor(int(torch.randint(0, n_steps, (), generator=g)), dtype=torch.int32)
            else:
                col = torch.randint(0, n_steps, (num_tokens,), generator=g, dtype=torch.int32)
                per_token = True
        view = logits[1:, :vocab]
        watch = {"logits": logits, "mapping": mapping, "temp": temp, "seeds": seeds, "pos": pos,
                 "local_argmax": local_argmax, "local_max": local_max}
        if out is not None:
            watch["processed"] = out
        if col is not None:
            watch["col"] = col
        return Launch(
            grid=(num_tokens, num_blocks),
            args=(local_argmax, local_argmax.stride(0), local_max, local_max.stride(0), out,
                  out.stride(0) if out is not None else 0, col, view, view.stride(0), mapping, seeds, pos, temp,
                  vocab),
            kwargs={"BLOCK_SIZE": BLOCK, "APPLY_TEMPERATURE": apply_temperature, "USE_FP64": use_fp64,
                    "PER_TOKEN_COL": per_token},
            watch=watch)

    return make


def sampled(launch: Launch) -> torch.Tensor:
    """The launcher's reduction of the per-block outputs (gumbel_sample's last two lines)."""
    nb = launch.grid[1]
    local_max, local_argmax = launch.watch["local_max"][:, :nb], launch.watch["local_argmax"][:, :nb]
    return local_argmax.gather(-1, local_max.argmax(dim=-1, keepdim=True)).view(-1)


def gumbel_differential(make, seeds, *, use_fp64: bool = False) -> None:
    """Interpreter vs native: exact everywhere except seeded rows' per-block values (see module docstring)."""
    kernel = vmod._gumbel_sample_kernel
    for seed in seeds:
        ref, got = make(seed), make(seed)
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        what = f"seed={seed}"
        assert torch.equal(sampled(ref), sampled(got)), f"{what}: sampled tokens differ"
        exact = {k: v for k, v in ref.watch.items() if k not in ("local_max", "local_argmax")}
        assert_same(exact, {k: got.watch[k] for k in exact}, what=what)
        tol = FP64_NOISE_ATOL if use_fp64 else FP32_NOISE_ATOL
        assert_same({"local_max": ref.watch["local_max"]}, {"local_max": got.watch["local_max"]}, what=what,
                    atol={"local_max": tol})
        # Greedy rows (no noise) must be bit-exact in both per-block outputs.
        temp, mapping = ref.watch["temp"], ref.watch["mapping"].long()
        greedy = (mapping < 0) | (temp[mapping.clamp_min(0)] == 0)
        assert_same({k: ref.watch[k][greedy] for k in ("local_max", "local_argmax")},
                    {k: got.watch[k][greedy] for k in ("local_max", "local_argmax")}, what=f"{what} greedy rows")
        bad = ref.watch["local_argmax"] != got.watch["local_argmax"]
        _MISMATCHES["blocks"] += bad.numel()
        _MISMATCHES["argmax"] += int(bad.sum())
    assert _MISMATCHES["argmax"] <= max(1, _MISMATCHES["blocks"] // 10_000), _MISMATCHES


@pytest.mark.parametrize("num_tokens,vocab", [(1, 1000), (5, 5003), (2, 51864)])
def test_gumbel_greedy_exact(num_tokens, vocab):
    # All-greedy batches (the default path of every temperature-0 request) with ties, NaNs and invalid rows.
    make = make_gumbel_case(num_tokens, vocab, temps="greedy", invalid=True, ties=True, nans=True)
    assert differential(vmod._gumbel_sample_kernel, make, range(2)) == 2


@pytest.mark.parametrize("use_fp64", [False, True])
@pytest.mark.parametrize("num_tokens,vocab,seeds", [(1, 1000, range(4)), (6, 5003, range(3)), (1, 51864, [0])])
def test_gumbel_seeded(num_tokens, vocab, seeds, use_fp64):
    make = make_gumbel_case(num_tokens, vocab, temps="mixed", use_fp64=use_fp64, invalid=num_tokens > 1,
                            nans=num_tokens > 1)
    gumbel_differential(make, seeds, use_fp64=use_fp64)


@pytest.mark.parametrize("processed", [None, "plain", "col", "per_token"])
@pytest.mark.parametrize("apply_temperature", [False, True])
def test_gumbel_processed_logits(processed, apply_temperature):
    make = make_gumbel_case(6, 2500, temps="mixed", apply_temperature=apply_temperature, processed=processed,
                            invalid=True)
    gumbel_differential(make, range(2))


def test_gumbel_all_temperature_one_fp64_processed():
    # Default OpenAI sampling: every row temperature 1.
    make = make_gumbel_case(3, 5003, temps="seeded", apply_temperature=True, use_fp64=True, processed="col")
    gumbel_differential(make, range(2), use_fp64=True)


@pytest.mark.parametrize("temps", ["greedy", "mixed"])
def test_gumbel_bf16_matches_fp32_reference(temps):
    make = make_gumbel_case(4, 3000, temps=temps, dtype=torch.bfloat16, processed="plain", apply_temperature=True)

    def make_ref(seed: int) -> Launch:
        launch = make(seed)
        full = launch.watch["logits"].float()
        args = list(launch.args)
        args[7] = full[1:, :args[13]]
        launch.args = tuple(args)
        launch.watch["logits"] = full
        return launch

    kernel = vmod._gumbel_sample_kernel
    for seed in range(2):
        ref, got = make_ref(seed), make(seed)
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        assert torch.equal(sampled(ref), sampled(got))
        ref.watch["logits"] = ref.watch["logits"].to(torch.bfloat16)
        exact = {k: v for k, v in ref.watch.items() if k != "local_max"} if temps == "mixed" else ref.watch
        assert_same(exact, {k: got.watch[k] for k in exact}, what=f"seed {seed}")
        torch.testing.assert_close(got.watch["local_max"], ref.watch["local_max"], atol=FP32_NOISE_ATOL, rtol=0)


def test_mismatch_report():
    # Runs last in this file: the count of seeded per-block argmax disagreements over all cases above.
    print(f"\nseeded per-block argmax mismatches: {_MISMATCHES['argmax']} of {_MISMATCHES['blocks']} blocks")
    assert _MISMATCHES["argmax"] <= max(1, _MISMATCHES["blocks"] // 10_000)


# --------------------------------------------------------------------------------------------------------
# Dispatch: vLLM's own launchers reach the native code


def test_dispatch_routes_gumbel_sample_and_apply_temperature(monkeypatch):
    native_entry(vmod._gumbel_sample_kernel)
    g = torch.Generator().manual_seed(5)
    num_tokens, vocab = 3, 51864
    logits = torch.randn(num_tokens, vocab, generator=g) * 3
    mapping = torch.tensor([2, 0, 1], dtype=torch.int32)
    temp = torch.tensor([0.0, 1.0, 0.7])
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    pos = torch.tensor([10, 20, 30], dtype=torch.int64)

    def run() -> tuple[torch.Tensor, torch.Tensor, float]:
        x = logits.clone()
        t0 = time.perf_counter()
        vmod.apply_temperature(x, mapping, temp)
        tokens = vmod.gumbel_sample(x, mapping, temp, seeds, pos, apply_temperature=False)
        return x, tokens, time.perf_counter() - t0

    ref_logits, ref_tokens, t_interp = run()  # not installed: the interpreter
    # Production has PyPI triton's libdevice stub (log1p returns None); the native path must not need it.
    from triton.language.extra import libdevice
    monkeypatch.setattr(libdevice, "log1p", lambda *args, **kwargs: None)
    with native_launches() as launched:
        got_logits, got_tokens, t_native = run()
    assert launched["_gumbel_sample_kernel"] == 1
    assert launched["_temperature_kernel"] == 1
    assert torch.equal(got_logits, ref_logits)
    assert torch.equal(got_tokens, ref_tokens)
    print(f"\napply_temperature + gumbel_sample, 3 x {vocab}: interpreter {t_interp * 1e3:.0f} ms, "
          f"native {t_native * 1e3:.1f} ms")
