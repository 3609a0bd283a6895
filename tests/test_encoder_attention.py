"""Encoder attention (mmcpu/attention.py, patches 0024-0025): every implementation against vLLM's path as shipped.

Randomised but seeded cases: batch sizes, sequence lengths (Whisper's 1500 frames, CLIP's 17 tokens, odd sizes),
head counts and sizes (32, 64, 80), GQA, Qwen2-VL-style varlen cu_seqlens with the zero-length segments vLLM pads
them with, q/k/v as strided views of one fused qkv projection (as the models hand them over), float32 and bfloat16.
The reference is the shipped path (SDPA on strided views) in float32 on the same inputs; the allowed error is
mmcpu.attention.tolerance (bf16: twice the 2^-8 * max|v| bound of the two roundings a float32-accumulating kernel
adds - P before P @ V and the output; float32: summation order only). Against the shipped path in bf16 itself
(which rounds the same two places) the bound doubles.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from mmcpu import attention as A
from mmcpu import cpu
from mmcpu.config import REPO_ROOT

KERNELS = ("extend", "cpu_attn")  # vLLM's _C kernels; each is checked on this CPU or skipped naming what it lacks
DTYPES = (torch.float32, torch.bfloat16)
CPU = cpu.current()
X86 = platform.machine() in ("x86_64", "AMD64")


def lacking_isa(impl: str) -> str | None:
    """The CPU feature this CPU lacks for ``impl``'s op, None if it has it: extend is only in the _C build vLLM
    loads on CPUs with avx512_bf16; cpu_attn is in every x86 build."""
    if not X86:
        return f"{impl}: vLLM's x86 _C kernel; this CPU is {platform.machine()}"
    if impl == "extend" and A.EXTEND_ISA not in CPU.flags:
        return f"extend: needs {A.EXTEND_ISA} (vLLM's _C for AVX-512 BF16 and AMX CPUs); this CPU: {CPU.line()}"
    return None


def kernel_here(impl: str, dtype: torch.dtype, d: int, h: int, hkv: int) -> None:
    """A kernel that fails its self-check on this CPU fails the test with the reason; a CPU without the ISA, or a
    dtype / head size the kernel does not take, skips it, naming which."""
    if why := lacking_isa(impl):
        pytest.skip(why)
    if not A.has_impl(impl):
        pytest.fail(
            f"{impl}: this CPU has what it needs ({CPU.line()}) but the _C vLLM loaded "
            f"({cpu.loaded_vllm_c()}) has no such op"
        )
    if why := A.unsupported(impl, dtype, d):
        pytest.skip(f"{impl}: {why}")
    if why := A.self_check(impl, dtype, d, h, hkv):
        pytest.fail(
            f"{impl} fails its self-check on this CPU ({CPU.line()}), {dtype}, head size {d}, {h}/{hkv} heads: {why}"
        )


def qkv_views(b, s, h, hkv, d, dtype, gen):
    """q, k, v as the models produce them: views into one (b, s, (h + 2 hkv) d) projection output."""
    fused = torch.randn((b, s, (h + 2 * hkv) * d), generator=gen).to(dtype)
    q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)


def random_cu(s: int, gen: torch.Generator, pad: int) -> torch.Tensor:
    """cu_seqlens over s with 1-4 segments, then ``pad`` repeats of the end (vLLM pads Qwen2-VL's to a fixed
    count: zero-length segments)."""
    n = int(torch.randint(1, 5, (1,), generator=gen))
    cuts = sorted(set(torch.randint(1, s, (n - 1,), generator=gen).tolist())) if s > 1 else []
    return torch.tensor([0, *cuts, s] + [s] * pad, dtype=torch.int32)


def cases(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    fixed = [(1, 1500, 6, 6, 64, False), (1, 17, 2, 2, 32, False), (1, 2048, 2, 2, 32, True), (2, 300, 8, 8, 64, False)]
    yield from fixed
    for _ in range(n):
        b = int(torch.randint(1, 4, (1,), generator=gen))
        s = int(torch.randint(1, 300, (1,), generator=gen))
        d = (32, 64, 80)[int(torch.randint(0, 3, (1,), generator=gen))]
        hkv = int(torch.randint(1, 5, (1,), generator=gen))
        h = hkv * (2 if torch.rand((1,), generator=gen).item() < 0.25 else 1)
        yield b, s, h, hkv, d, torch.rand((1,), generator=gen).item() < 0.5


CASES = list(cases(6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", [*KERNELS, "sdpa", "auto"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-s{}-h{}/{}-d{}{}".format(*c[:5], "-varlen" if c[5] else ""))
def test_matches_the_shipped_path(case, impl, dtype):
    b, s, h, hkv, d, varlen = case
    if impl in KERNELS:
        kernel_here(impl, dtype, d, h, hkv)
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    q, k, v = qkv_views(b, s, h, hkv, d, dtype, gen)
    cu = random_cu(s, gen, pad=int(torch.randint(0, 3, (1,), generator=gen))) if varlen else None
    gqa, scale = h != hkv, d**-0.5
    got = A.encoder_attention(q, k, v, scale, cu, gqa, impl=None if impl == "auto" else impl)
    assert got.shape == (b, s, h, d) and got.dtype == dtype and got.is_contiguous()
    vmax = v.float().abs().max().item()
    ref = A.reference(q, k, v, scale, cu, gqa)
    assert (got.float() - ref).abs().max().item() <= A.tolerance(dtype, vmax)
    shipped = A.sdpa_strided(q, k, v, scale, cu, gqa)
    assert (got.float() - shipped.float()).abs().max().item() <= 2 * A.tolerance(dtype, vmax)


def test_small_problems_take_the_shipped_path_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    q, k, v = qkv_views(1, 17, 2, 2, 32, torch.bfloat16, gen)
    assert torch.equal(A.encoder_attention(q, k, v), A.sdpa_strided(q, k, v, 32**-0.5))


def test_segments_skip_empty_and_offset_batch_rows():
    cu = torch.tensor([0, 3, 3, 5, 5], dtype=torch.int32)
    assert A.segments(2, 5, cu) == [(0, 3), (3, 2), (5, 3), (8, 2)]
    assert A.segments(2, 4, None) == [(0, 4), (4, 4)]
    with pytest.raises(ValueError):
        A.segments(1, 5, torch.tensor([0, 4], dtype=torch.int32))


def test_choice_falls_back_when_a_kernel_fails_its_self_check(monkeypatch):
    """A kernel that returns wrong numbers on this CPU is never used: the next one in PREFERENCE is."""
    here = [i for i in KERNELS if A.has_impl(i)]
    if not here:
        pytest.skip(lacking_isa("cpu_attn") or "no vLLM _C attention kernel loaded")
    monkeypatch.setattr(A, "_choice", {})
    broken = {i: (lambda q, *a, **kw: torch.zeros_like(q)) for i in here}
    monkeypatch.setattr(A, "_FUNCS", {**A._FUNCS, **broken})
    for impl in here:
        assert A.self_check(impl, torch.bfloat16, 64, 6, 6).startswith("max abs error")
    assert A.choose(torch.bfloat16, 64, 6, 6) == "sdpa"


def test_a_kernel_failing_its_self_check_fails_the_test_with_the_reason(monkeypatch):
    """kernel_here: wrong numbers from a kernel this CPU runs are a failure naming the error, not a skip."""
    if lacking_isa("cpu_attn") or not A.has_impl("cpu_attn"):
        pytest.skip(lacking_isa("cpu_attn") or "no cpu_attn here")
    monkeypatch.setattr(A, "_FUNCS", {**A._FUNCS, "cpu_attn": lambda q, *a, **kw: torch.zeros_like(q)})
    with pytest.raises(pytest.fail.Exception, match=r"cpu_attn fails its self-check on this CPU .*max abs error"):
        kernel_here("cpu_attn", torch.bfloat16, 64, 6, 6)
    with pytest.raises(pytest.skip.Exception, match="head size 48 not supported"):
        kernel_here("cpu_attn", torch.bfloat16, 48, 6, 6)  # the kernel's limit: a skip naming it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_choice_here_is_the_first_kernel_that_applies(dtype):
    """On an x86 CPU the choice is extend where it applies (bf16 on a CPU with avx512_bf16), else the paged
    kernel: a preferred kernel that fails its self-check here fails this test with its reason, not a fallback."""
    for impl in A.PREFERENCE[dtype]:
        if impl == "sdpa":
            break
        if lacking_isa(impl) or A.unsupported(impl, dtype, 64):
            continue
        kernel_here(impl, dtype, 64, 6, 6)
        assert A.choose(dtype, 64, 6, 6) == impl
        return
    pytest.skip(lacking_isa("cpu_attn") or "no vLLM _C attention kernel applies here")


def test_forced_avx2_build_falls_back_to_the_paged_kernel():
    """vLLM's AVX2 build (Zen 3 class CPUs) has no extend kernel: loaded here by forcing vLLM's CPU probe, the
    choice must be cpu_attn (vec ISA) and its outputs within tolerance."""
    code = textwrap.dedent("""
        import torch
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False  # vLLM's paged kernel would pick its AMX ISA on a Xeon
        import vllm._custom_ops
        from mmcpu import attention as A, cpu
        assert cpu.loaded_vllm_c() == ["_C_AVX2.abi3.so"], cpu.loaded_vllm_c()
        assert not A.has_impl("extend")
        for dt in (torch.bfloat16, torch.float32):
            assert A.choose(dt, 64, 6, 6) == "cpu_attn", dt
            assert A._cpu_attn_isa(dt, 64) == "vec"
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn((1, 1500, 6, 64), generator=g).to(dt) for _ in range(3))
            cu = torch.tensor([0, 700, 1500, 1500], dtype=torch.int32)
            got = A.encoder_attention(q, k, v, None, cu)
            err = (got.float() - A.reference(q, k, v, 0.125, cu)).abs().max().item()
            assert err <= A.tolerance(dt, v.float().abs().max().item()), err
        print("ok")
    """)
    if not (
        A.has_impl("cpu_attn")
        and any("AVX2" in p.name for p in (REPO_ROOT / ".cache").glob("venv/lib/*/site-packages/vllm/_C_AVX2*.so"))
    ):
        pytest.skip("no AVX2 build of vLLM here")
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-s{}-h{}/{}-d{}{}".format(*c[:5], "-varlen" if c[5] else ""))
def test_kernels_read_qkv_views_as_dense_copies(case, impl):
    """_C's kernels get q/k/v split from one fused projection as views with a token stride (no copies): the
    result is bit-identical to the same call on dense copies."""
    b, s, h, hkv, d, varlen = case
    kernel_here(impl, torch.bfloat16, d, h, hkv)
    gen = torch.Generator().manual_seed(hash(case) % 2**31 + 1)
    q, k, v = qkv_views(b, s, h, hkv, d, torch.bfloat16, gen)
    assert not q.is_contiguous() and A._flat(q).data_ptr() == q.data_ptr()  # a view, not a copy
    cu = random_cu(s, gen, pad=1) if varlen else None
    fn, gqa = getattr(A, impl), h != hkv
    assert torch.equal(
        fn(q, k, v, d**-0.5, cu, gqa), fn(q.contiguous(), k.contiguous(), v.contiguous(), d**-0.5, cu, gqa)
    )


def test_vllm_wrapper_routes_here_and_its_layout_is_dense():
    """With patches 0024-0025 applied: vLLM's torch_sdpa_wrapper on CPU returns encoder_attention's result, and
    apply_sdpa (the SDPA fallback) hands SDPA dense tensors, with the shipped numbers."""
    wrappers = pytest.importorskip("vllm.v1.attention.ops.vit_attn_wrappers")
    import inspect

    if "mmcpu.attention" not in inspect.getsource(wrappers.torch_sdpa_wrapper):
        pytest.skip("patches/0025 not applied to this vLLM")
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv_views(1, 600, 6, 6, 64, torch.bfloat16, gen)
    cu = torch.tensor([0, 250, 600, 600], dtype=torch.int32)
    for c in (None, cu):
        got = wrappers.torch_sdpa_wrapper(q, k, v, 0.125, c)
        assert torch.equal(got, A.encoder_attention(q, k, v, 0.125, c))
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        seen.append(all(x.is_contiguous() for x in (q_, k_, v_)))
        return real(q_, k_, v_, **kw)

    import unittest.mock

    with unittest.mock.patch.object(wrappers.F, "scaled_dot_product_attention", spy):
        out = wrappers.apply_sdpa(q, k, v, scale=0.125)
    assert seen == [True]
    vmax = v.float().abs().max().item()
    assert (out.float() - A.sdpa_strided(q, k, v, 0.125).float()).abs().max().item() <= 2 * A.tolerance(
        torch.bfloat16, vmax
    )


def test_bench_shapes_follow_the_fixture_configs():
    from mmcpu_dev.bench import attention as bench

    shapes = {s.name: s for s in bench.shapes()}
    tiny = shapes["whisper-tiny.en"]
    assert (tiny.b, tiny.s, tiny.heads, tiny.head_size, tiny.fc1) == (1, 1500, 6, 64, (1500, 384, 1536))
    assert (shapes["whisper-base"].heads, shapes["whisper-base"].head_size) == (8, 64)
    assert shapes["tiny-llava"].s == 17 and shapes["tiny-qwen2-vl-2x448px"].cu_seqlens == (0, 1024, 2048)
    assert tiny.flops == 4 * 6 * 64 * 1500**2
