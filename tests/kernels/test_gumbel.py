"""``_temperature_kernel`` and ``_gumbel_sample_kernel``: native vs interpreter, bit-exact.

Exact: the murmur3 stream (``murmur3_hash32`` and the fp32 / fp64 uniforms built from it, checked also against
an independent MurmurHash3_x86_32), ``_log1p_neg_stable``, temperature scaling, every per-block max and argmax
(seeded rows included), every logits-cache store, and every sampled token (the launcher's reduction of the
per-block outputs). The per-block values are exact because the native noise uses numpy's ``log`` and the
native reduction ``np.max`` / ``np.argmax``, which is what Triton's interpreter computes them with; exactness
against compiled Triton on a GPU would end at ``log``'s last bit (libdevice vs numpy), which can move a
per-block argmax only where a block's two best candidates lie within an ulp.

bfloat16 logits: the interpreter cannot build bf16 constants (the kernels' ``other=-inf`` loads), so bf16 is
checked against the interpreter on the fp32 upcast; both kernels upcast on load, so that is exact.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from diff import Launch, assert_same, differential, native_entry, native_launches, run_interpreter, run_native
from vllm.v1.worker.gpu.sample import gumbel as vmod

from mmcpu.kernels.sample import gumbel as ngumbel

BLOCK = 1024

# --------------------------------------------------------------------------------------------------------
# murmur3 stream


@triton.jit
def _probe_kernel(seed_ptr, pos_ptr, h_ptr, h_hi_ptr, u32_ptr, u64_ptr, l1p_ptr, n, B: tl.constexpr):
    # vLLM's own device functions, launched on (row, vocab block) as gumbel_noised_argmax calls them.
    t = tl.program_id(0).to(tl.int64)
    seed, pos = tl.load(seed_ptr + t), tl.load(pos_ptr + t)
    block = tl.program_id(1) * B + tl.arange(0, B)
    m = block < n
    tl.store(h_ptr + t * n + block, vmod.murmur3_hash32(seed, pos, block).to(tl.int64), mask=m)
    tl.store(h_hi_ptr + t * n + block, vmod.murmur3_hash32(seed, pos, block, domain=0x9E3779B9).to(tl.int64), mask=m)
    u32 = vmod.murmur3_uniform32(seed, pos, block)
    tl.store(u32_ptr + t * n + block, u32, mask=m)
    tl.store(u64_ptr + t * n + block, vmod.murmur3_uniform64(seed, pos, block), mask=m)
    tl.store(l1p_ptr + t * n + block, vmod._log1p_neg_stable(u32), mask=m)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_murmur3_bit_exact(pos_dtype):
    n, rows = 3000, 6
    g = torch.Generator().manual_seed(11)
    seed = torch.cat(
        [
            torch.tensor([0, -1, 2**63 - 1, -(2**63)], dtype=torch.int64),
            torch.randint(-(2**63), 2**63 - 1, (rows - 4,), generator=g, dtype=torch.int64),
        ]
    )
    if pos_dtype == torch.int64:  # only the position's low word is hashed; negative ones wrap
        pos = torch.tensor([0, 1, 2**32 + 5, -1, 2**40 + 123, 77], dtype=torch.int64)
    else:
        pos = torch.tensor([0, 1, 2**31 - 1, -1, -(2**31), 77], dtype=torch.int32)
    h, h_hi = torch.zeros(rows, n, dtype=torch.int64), torch.zeros(rows, n, dtype=torch.int64)
    u32, l1p, u64 = torch.zeros(rows, n), torch.zeros(rows, n), torch.zeros(rows, n, dtype=torch.float64)
    _probe_kernel[(rows, triton.cdiv(n, BLOCK))](seed, pos, h, h_hi, u32, u64, l1p, n, B=BLOCK)

    s, p = seed.numpy(), pos.numpy()
    assert np.array_equal(ngumbel.murmur3_hash32(s, p, n).astype(np.int64), h.numpy())
    assert np.array_equal(ngumbel.murmur3_hash32(s, p, n, ngumbel.DOMAIN_HI).astype(np.int64), h_hi.numpy())
    got32 = ngumbel.murmur3_uniform32(s, p, n)
    assert np.array_equal(got32, u32.numpy()) and got32.dtype == np.float32
    assert bool((got32 > 0).all() and (got32 < 1).all())
    assert np.array_equal(ngumbel.murmur3_uniform64(s, p, n), u64.numpy())
    assert np.array_equal(ngumbel.log1p_neg_stable(got32), l1p.numpy())
    # The hash is murmur3_x86_32 over 16 bytes (seed lo, seed hi, position lo, offset): a known-answer check
    # against an independent scalar implementation, so the native stream is not merely the kernel's mirror.
    assert int(h[2, 1234]) == _murmur3_x86_32(
        struct.pack("<IIII", (2**63 - 1) & 0xFFFFFFFF, 2**31 - 1, int(pos[2]) & 0xFFFFFFFF, 1234), 0
    )


def _murmur3_x86_32(data: bytes, seed: int) -> int:
    """Reference MurmurHash3_x86_32 (Austin Appleby's algorithm) in plain Python integers."""
    m = 0xFFFFFFFF
    h = seed
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


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
        return Launch(
            grid=(num_tokens, triton.cdiv(vocab, 8192)),
            args=(view, view.stride(0), mapping, temp, vocab),
            kwargs={"BLOCK_SIZE": 8192},
            watch={"logits": logits, "mapping": mapping, "temp": temp},
        )

    return make


@pytest.mark.parametrize("num_tokens,vocab", [(1, 1000), (4, 5003), (3, 51864), (2, 20000)])
def test_temperature_fp32(num_tokens, vocab):
    assert (
        differential(vmod._temperature_kernel, make_temperature_case(num_tokens, vocab, torch.float32), range(3)) == 3
    )


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


def make_gumbel_case(
    num_tokens: int,
    vocab: int,
    *,
    temps: str = "mixed",
    use_fp64: bool = False,
    apply_temperature: bool = False,
    cache: str | None = None,
    invalid: bool = False,
    ties: bool = False,
    nans: bool = False,
    drafting: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """A launch as ``gumbel_sample`` makes it; ``cache``: None, "col" (one 0-d column), "per_token" (a column per
    token, tokens of one request sharing its row as in speculative decoding), "source" (per token, the cached
    logits read from a separate source tensor)."""
    num_blocks = triton.cdiv(vocab, BLOCK)

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_tokens + 4
        logits = torch.randn(num_tokens + 1, vocab + 9, generator=g) * 3
        if ties:  # many equal maxima: the first index of a block's max must win
            logits = logits.round().clamp(-3, 2)
        if nans:  # a NaN wins its block (first NaN's index), as np.max / np.argmax have it
            logits[1 + num_tokens // 2, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
        logits[1:, torch.randint(0, vocab, (5,), generator=g)] = float("-inf")  # masked tokens (bias, bitmask)
        logits = logits.to(dtype)
        if cache in ("per_token", "source"):
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
        elif temps == "one":
            temp.fill_(1.0)
        seeds = torch.randint(-(2**63), 2**63 - 1, (max_reqs,), generator=g, dtype=torch.int64)
        pos = torch.randint(0, 4096, (num_tokens,), generator=g, dtype=torch.int64)
        # Sentinels in the outputs: every element the kernel writes, and only those, must match.
        local_argmax = torch.full((num_tokens, num_blocks + 2), -7, dtype=torch.int64)
        local_max = torch.full((num_tokens, num_blocks + 2), -7.0, dtype=torch.float64 if use_fp64 else torch.float32)
        view = logits[1:, :vocab]
        out = col = source = None
        per_token = False
        if cache is not None:
            n_cols = 3
            out = torch.full((max_reqs, n_cols, vocab + 2), 5.0, dtype=dtype)  # wider than the vocab
            if cache == "col":
                col = torch.tensor(int(torch.randint(0, n_cols, (), generator=g)), dtype=torch.int64)
            else:
                col = torch.randint(0, n_cols, (num_tokens,), generator=g, dtype=torch.int64)
                per_token = True
            source = torch.randn(num_tokens, vocab + 4, generator=g).to(dtype)[:, :vocab] if cache == "source" else view
        watch = {
            "logits": logits,
            "mapping": mapping,
            "temp": temp,
            "seeds": seeds,
            "pos": pos,
            "local_argmax": local_argmax,
            "local_max": local_max,
        }
        if out is not None:
            watch |= {"cache": out, "col": col}
        return Launch(
            grid=(num_tokens, num_blocks),
            args=(
                local_argmax,
                local_argmax.stride(0),
                local_max,
                local_max.stride(0),
                out,
                out.stride(0) if out is not None else 0,
                out.stride(1) if out is not None else 0,
                col,
                source,
                source.stride(0) if source is not None else 0,
                view,
                view.stride(0),
                mapping,
                seeds,
                pos,
                temp,
                vocab,
            ),
            kwargs={
                "BLOCK_SIZE": BLOCK,
                "IS_DRAFTING": drafting,
                "APPLY_TEMPERATURE": apply_temperature,
                "USE_FP64": use_fp64,
                "PER_TOKEN_COL": per_token,
            },
            watch=watch,
        )

    return make


def sampled(launch: Launch) -> torch.Tensor:
    """The launcher's reduction of the per-block outputs (gumbel_sample's last two lines)."""
    nb = launch.grid[1]
    local_max, local_argmax = launch.watch["local_max"][:, :nb], launch.watch["local_argmax"][:, :nb]
    return local_argmax.gather(-1, local_max.argmax(dim=-1, keepdim=True)).view(-1)


def gumbel_differential(make, seeds) -> int:
    """Interpreter vs native, bit-exact in every output (per-block maxima and argmaxes included) and in the
    sampled tokens; returns how many tokens were sampled with noise."""
    kernel = vmod._gumbel_sample_kernel
    noisy = 0
    for seed in seeds:
        ref, got = make(seed), make(seed)
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        assert torch.equal(sampled(ref), sampled(got)), f"seed={seed}: sampled tokens differ"
        assert_same(ref.watch, got.watch, what=f"seed={seed}")
        mapping = ref.watch["mapping"].long()
        noisy += int(((mapping >= 0) & (ref.watch["temp"][mapping.clamp_min(0)] != 0)).sum())
    return noisy


@pytest.mark.parametrize("num_tokens,vocab", [(1, 1000), (5, 5003), (2, 51864)])
def test_gumbel_greedy_exact(num_tokens, vocab):
    # All-greedy batches (the default path of every temperature-0 request) with ties, NaNs and invalid rows.
    make = make_gumbel_case(num_tokens, vocab, temps="greedy", invalid=True, ties=True, nans=True)
    assert differential(vmod._gumbel_sample_kernel, make, range(2)) == 2


@pytest.mark.parametrize("use_fp64", [False, True])
@pytest.mark.parametrize("num_tokens,vocab,seeds", [(1, 1000, range(4)), (6, 5003, range(3)), (1, 51864, [0])])
def test_gumbel_seeded(num_tokens, vocab, seeds, use_fp64):
    make = make_gumbel_case(
        num_tokens,
        vocab,
        temps="mixed" if num_tokens > 1 else "seeded",
        use_fp64=use_fp64,
        invalid=num_tokens > 1,
        nans=num_tokens > 1,
    )
    assert gumbel_differential(make, seeds) > 0


@pytest.mark.parametrize("cache", [None, "col", "per_token", "source"])
@pytest.mark.parametrize("apply_temperature", [False, True])
def test_gumbel_logits_cache(cache, apply_temperature):
    make = make_gumbel_case(6, 2500, temps="mixed", apply_temperature=apply_temperature, cache=cache, invalid=True)
    assert gumbel_differential(make, range(2)) > 0


@pytest.mark.parametrize("use_fp64", [False, True])
def test_gumbel_drafting_noise_is_salted(use_fp64):
    # A draft (IS_DRAFTING) draws from position + 2**30: exact against the kernel, and not the target's noise.
    make = make_gumbel_case(4, 3000, temps="seeded", drafting=True, use_fp64=use_fp64, cache="per_token")
    assert gumbel_differential(make, range(2)) > 0
    target, draft = make_gumbel_case(4, 3000, temps="seeded", use_fp64=use_fp64)(0), make(0)
    run_native(vmod._gumbel_sample_kernel, target)
    run_native(vmod._gumbel_sample_kernel, draft)
    assert not torch.equal(target.watch["local_max"], draft.watch["local_max"])


def test_gumbel_all_temperature_one_fp64_cache():
    # Default OpenAI sampling: every row temperature 1.
    make = make_gumbel_case(3, 5003, temps="one", apply_temperature=True, use_fp64=True, cache="col")
    assert gumbel_differential(make, range(2)) == 6


@pytest.mark.parametrize("temps", ["greedy", "mixed"])
def test_gumbel_bf16_matches_fp32_reference(temps):
    # bf16 logits and cache: the reference is the interpreter on the fp32 upcast (the kernel upcasts on load),
    # its cache rounded back to bf16 (exact: the cached values are the bf16 inputs themselves).
    make = make_gumbel_case(4, 3000, temps=temps, dtype=torch.bfloat16, cache="col", apply_temperature=True)

    def make_ref(seed: int) -> Launch:
        launch = make(seed)
        full = launch.watch["logits"].float()
        args = list(launch.args)
        args[4] = launch.watch["cache"] = args[4].float()
        args[8] = args[10] = full[1:, : args[16]]
        launch.args = tuple(args)
        launch.watch["logits"] = full
        return launch

    kernel = vmod._gumbel_sample_kernel
    for seed in range(2):
        ref, got = make_ref(seed), make(seed)
        run_interpreter(kernel, ref)
        run_native(kernel, got)
        assert torch.equal(sampled(ref), sampled(got))
        for name in ("logits", "cache"):
            ref.watch[name] = ref.watch[name].to(torch.bfloat16)
        assert_same(ref.watch, got.watch, what=f"seed {seed}")


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
        tokens = vmod.gumbel_sample(x, mapping, temp, seeds, pos, apply_temperature=False, is_drafting=False)
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
    print(
        f"\napply_temperature + gumbel_sample, 3 x {vocab}: interpreter {t_interp * 1e3:.0f} ms, "
        f"native {t_native * 1e3:.1f} ms"
    )
