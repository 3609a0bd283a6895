"""An int8 model's output projection in int8 (patches/0030): vLLM's ``ParallelLMHead`` on CPU, proved against the
float projection on randomised inputs on every CPU (where this CPU has no int8 kernel for it, the float path vLLM
falls back to is proved against float32 instead; that fallback is also forced and checked here on any CPU), off
wherever it does not apply, and asked for by the launcher only for an int8 checkpoint. The engine-level checks
(an int8 engine's log, its WER) are in tests/test_quantize.py.

Where exactness ends: the int8 path rounds each weight to 1/127 of its row's largest magnitude and each activation
to 1/127 of its token's (symmetric), and accumulates exactly in int32; only those two roundings differ from the
float product. Each output's error is then at most half a weight step times the row's |x|-sum plus half an
activation step times the token's |w|-sum (plus the bf16 rounding of the output), which the test checks element by
element; the relative error over a whole output is ~1 % on these inputs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from vllm.model_executor.layers import utils  # the venv's vLLM: the default line, patched (0030 is not on the proof's)

from mmcpu import cpu, launch
from mmcpu.config import Settings
from mmcpu.defaults import Resolved

AMX = cpu.current().isa == "amx"
# Without AMX (or in float32) the projection runs on oneDNN's int8 GEMM, as the checkpoint's other int8 linears do
# there; the patch takes it only with VNNI, where that GEMM is exact int8 arithmetic.
VNNI = torch.cpu._is_vnni_supported()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Head(torch.nn.Module):
    """What the patch reads of a ParallelLMHead: its weight (vocabulary x hidden)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def dispatched(
    weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch, flag: str = "1", dtype: torch.dtype = torch.bfloat16
) -> tuple[Head, bool]:
    monkeypatch.setenv("MMCPU_INT8_LM_HEAD", flag)
    head = Head(weight)
    with default_dtype(dtype):
        return head, utils.dispatch_cpu_int8_lm_head(head)


def int8_kernel_here(dtype: torch.dtype) -> bool:
    """Whether this CPU runs a model of ``dtype``'s output projection in int8: the SGL kernel (AMX, bf16/fp16), or
    oneDNN's int8 GEMM with VNNI."""
    return (AMX and dtype != torch.float32) or VNNI


def float_fallback_matches(head: Head, w: torch.Tensor, dtype: torch.dtype, g: torch.Generator) -> None:
    """vLLM's own float dispatch of the layer (what the projection runs on where the int8 one does not apply)
    against float32: within the output's rounding (bf16: 2^-8 of each value) and the float32 accumulation."""
    utils.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    hidden = w.shape[1]
    for m in (1, 3, 17):
        x = (torch.randn(m, hidden, generator=g) * 4).to(dtype)
        out = head.cpu_linear(x, head.weight, None)
        assert out.shape == (m, w.shape[0]) and out.dtype == dtype
        ref = x.float() @ w.float().t()
        rounding = ref.abs() * (2**-8 if dtype == torch.bfloat16 else 0.0)
        bound = rounding + 2**-16 * (x.float().abs() @ w.float().abs().t()) + 1e-6
        err = (out.float() - ref).abs()
        assert (err <= bound).all(), float((err - bound).max())


def error_bound(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per element: the two int8 roundings (half a step each) plus the output's own bf16 rounding."""
    xf, wf = x.float(), w.float()
    w_step, x_step = wf.abs().amax(1) / 127, xf.abs().amax(1) / 127
    rounding = 0.5 * w_step[None, :] * xf.abs().sum(1, keepdim=True) + 0.5 * x_step[:, None] * wf.abs().sum(1)[None, :]
    return rounding + out.float().abs() * 2**-8 + 1e-6


def weights(vocab: int, hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    # Rows of different scales, as an embedding's are, and one all-zero row (its scale must stay positive).
    w = (torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g) * 0.1).to(dtype)
    w[7] = 0
    return w


@pytest.mark.parametrize(("vocab", "hidden"), [(51864, 384), (1003, 512)])  # tiny.en's; a vocabulary not of 16s
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # on AMX: the SGL kernel, then oneDNN
def test_matches_the_float_projection_within_int8_rounding(
    vocab: int, hidden: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
):
    """On every CPU: in int8 where this CPU has the kernel for it, else the float fallback, against float32."""
    g = torch.Generator().manual_seed(vocab)
    w = weights(vocab, hidden, dtype, g)
    head, took = dispatched(w, monkeypatch, dtype=dtype)
    assert took == int8_kernel_here(dtype), (AMX, VNNI, dtype)
    if not took:  # no int8 kernel for it here: what the model runs instead must equal float32
        assert not hasattr(head, "cpu_linear")
        float_fallback_matches(head, w, dtype, g)
        return
    for m in (1, 3, 17):
        x = (torch.randn(m, hidden, generator=g) * 4).to(dtype)
        out = head.cpu_linear(x, head.weight, None)
        assert out.shape == (m, vocab) and out.dtype == dtype
        ref = x.float() @ w.float().t()
        err = (out.float() - ref).abs()
        assert (err <= error_bound(x, w, out)).all(), float((err - error_bound(x, w, out)).max())
        assert float((out.float() - ref).norm() / ref.norm()) < 0.03
        assert out[:, 7].abs().max() == 0
        # Where the top logit leads by more than twice the largest error, the int8 argmax is the float one.
        top2 = ref.topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err.max(1).values
        assert torch.equal(out.float().argmax(1)[clear], ref.argmax(1)[clear])
    # A 3D input (batch, seq, hidden) keeps its leading dimensions; a bias is added.
    x = torch.randn(2, 2, hidden, generator=g).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype)
    out = head.cpu_linear(x, head.weight, bias)
    assert out.shape == (2, 2, vocab)
    assert torch.allclose(out.float() - head.cpu_linear(x, head.weight, None).float(), bias.float(), atol=0.07)


@pytest.mark.parametrize("flag", ["0", ""])
def test_changes_nothing_unless_asked(flag: str, monkeypatch: pytest.MonkeyPatch):
    """Not asked for: the layer is left to vLLM's own float dispatch."""
    head, took = dispatched(torch.randn(64, 32).to(torch.bfloat16), monkeypatch, flag)
    assert not took and not hasattr(head, "cpu_linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_an_int8_kernel_the_projection_is_the_float_one(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """A CPU with neither AMX nor VNNI, forced on this one (torch's probes answer no; on such a CPU they do): the
    patch leaves the layer alone and vLLM's float dispatch equals float32."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    g = torch.Generator().manual_seed(11)
    w = weights(1003, 512, dtype, g)
    head, took = dispatched(w, monkeypatch, dtype=dtype)
    assert not took and not hasattr(head, "cpu_linear")
    float_fallback_matches(head, w, dtype, g)


@pytest.mark.skipif(AMX or VNNI, reason="checks a CPU with neither AMX nor VNNI")
def test_off_without_amx_or_vnni(monkeypatch: pytest.MonkeyPatch):
    """AVX2 alone: oneDNN's u8 x s8 products saturate in int16, so the projection stays float."""
    for dtype in (torch.bfloat16, torch.float32):
        head, took = dispatched(torch.randn(64, 32).to(dtype), monkeypatch, dtype=dtype)
        assert not took and not hasattr(head, "cpu_linear")


@pytest.mark.parametrize(
    ("quantization", "setting", "kind", "expected"),
    [
        ("int8", True, "audio", "1"),
        ("none", True, "audio", "0"),
        ("int8", False, "audio", "0"),
        ("int8", True, "vision", "0"),
    ],
)
def test_launcher_asks_for_it_for_an_int8_whisper_checkpoint_only(
    quantization: str, setting: bool, kind: str, expected: str
):
    spec = launch.EngineSpec("audio", "/models/whisper-tiny.en", 8001, kind=kind)
    chosen = Resolved(
        model="/models/whisper-tiny.en-int8" if quantization == "int8" else "/models/whisper-tiny.en",
        dtype="bfloat16",
        quantization=quantization,
        why="test",
    )
    proc = spec.process(Settings(int8_lm_head=setting), chosen, base={"MMCPU_INT8_LM_HEAD": "1"})
    assert proc.env["MMCPU_INT8_LM_HEAD"] == expected
