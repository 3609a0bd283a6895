"""float32 linears on CPU: vLLM's oneDNN path (what the engines run) against torch's F.linear.

`docs/bench/float32.md`: on x86 vLLM's ``dispatch_cpu_unquantized_gemm`` hands every float32 linear weight to
oneDNN (``onednn_mm``), 2.1-2.5x MKL's SGEMM behind ``F.linear`` at Whisper's encoder shapes on an AVX-512 CPU.
These tests pin both facts that the figures rely on: the dispatch picks oneDNN for float32 on this CPU, and its
results equal F.linear's to float32 accuracy (relative error <= 1e-5 of the output's scale; the two differ only in
summation order) on randomised inputs, Whisper's shapes and awkward ones.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm._custom_ops")
F = torch.nn.functional

SHAPES = [
    (1500, 384, 1536),
    (1500, 1536, 384),
    (1500, 384, 1152),
    (1, 384, 1536),
    (8, 384, 1536),
    (3, 384, 51864),
    (1500, 512, 2048),
    (1, 2048, 512),
    (7, 33, 65),
    (1, 1, 1),
]


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_onednn_mm_float32_matches_f_linear(m: int, k: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scale = float(torch.empty(1).uniform_(-3, 3, generator=gen).exp())  # inputs over several orders of magnitude
    x = torch.randn((m, k), generator=gen) * scale
    w = torch.randn((n, k), generator=gen) / k**0.5
    b = torch.randn((n,), generator=gen)
    handler = ops.create_onednn_mm(w.t(), 32)  # as vLLM's dispatch: a [K, N] view of the [N, K] weight
    for bias in (b, None):
        got = ops.onednn_mm(handler, x, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert rel_err(got.double(), ref) <= 1e-5
        # As accurate as torch's own float32 GEMM, up to a few float32 rounding steps of a k-term sum: the two sum
        # in other orders, and where MKL's order happens to be very exact (Intel Xeon with AMX: 9.7e-8 against
        # oneDNN's 5.3e-7 at k=384) a ratio alone would fail what is plain float32 accuracy.
        eps32 = torch.finfo(torch.float32).eps
        assert rel_err(got.double(), ref) <= 4 * rel_err(F.linear(x, w, bias).double(), ref) + k**0.5 * eps32


def test_dispatch_takes_onednn_for_float32_linears() -> None:
    """vLLM's CPU linear dispatch installs oneDNN, not F.linear, for a float32 Linear weight on this CPU."""
    from vllm.model_executor.layers import utils

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN ops")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(1536, 384), requires_grad=False)
    weight = layer.weight.data.clone()
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.cpu_linear is not F.linear and layer.weight.numel() == 0
    x = torch.randn(1500, 384)
    assert rel_err(layer.cpu_linear(x, None, None).double(), F.linear(x.double(), weight.double())) <= 1e-5
