"""python -m mmcpu_dev.bench attention: encoder attention GFLOP/s per implementation, beside the GEMM rate.

Shapes are read from the fixtures' configs under ``.cache/models`` (built-in copies of their figures when a fixture
is missing): Whisper tiny.en and base (one padded 30 s window: 1500 frames), the CLIP towers of tiny-llava and
llava-smollm2 (the bench's 96 px image -> 17 tokens), tiny-qwen2-vl's ViT for the bench's image (36 patches) and
for two 448 px images in one varlen call (cu_seqlens 0, 1024, 2048). Per shape and dtype (float32, bfloat16; the
int8 default runs its attention in bfloat16, so its row is the bfloat16 attention against the int8 GEMM), every
implementation of :mod:`mmcpu.attention` that runs here is timed, interleaved, median of ``reps`` rounds:

- ``sdpa_strided``: vLLM's path as shipped (SDPA on transposed views), ``sdpa``: contiguous layout (patches/0024),
  ``extend`` / ``cpu_attn``: vLLM's ``_C`` kernels, ``auto``: what :func:`mmcpu.attention.encoder_attention`
  picks on this CPU (mmcpu.plugin installs it in the engine);
- ``gemm``: the model's fc1 (tokens x d_model @ d_model x ffn) through vLLM's oneDNN handlers, as its linear
  layers run: float32 / bfloat16 (``create_onednn_mm``), int8 W8A8 with dynamic per-token activation
  quantisation included (``create_onednn_scaled_mm``), GFLOP/s;
- ``ratio``: ``auto`` / ``gemm`` of the same dtype (bfloat16 attention / int8 GEMM for the int8 row).

Each shape records the 1-min load average and the cores other processes used while it ran (``CpuWatch``): on a
shared machine every figure is disturbed by that much; compare implementations only within one shape's row.

Interface for ``make bench``: :func:`headline` (``reps``) returns
``{shape: {impl: bf16 GFLOP/s}, "gemm_bf16": GFLOP/s, "ratio": float}`` - every shape's bfloat16 attention rates,
Whisper tiny.en's bf16 fc1 GEMM rate and its ``auto`` / GEMM ratio (the headline key). :func:`measure` returns the
full record (CPU, load, every dtype) that ``main`` prints and writes as JSON (``--json``, default
``.cache/bench-attention/attention.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mmcpu import attention, cpu
from mmcpu.config import REPO_ROOT

MODELS = REPO_ROOT / ".cache" / "models"
BENCH_IMAGE_PX = 96  # mmcpu_dev.payloads.test_image's default size


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    s: int
    heads: int
    head_size: int
    cu_seqlens: tuple[int, ...] | None
    fc1: tuple[int, int, int]  # tokens, d_model, ffn

    @property
    def flops(self) -> float:
        return attention.flops(
            self.b, self.s, self.heads, self.head_size, list(self.cu_seqlens) if self.cu_seqlens else None
        )


def _config(model: str) -> dict:
    path = MODELS / model / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _qwen2_vl_patches(px: int, patch: int, merge: int) -> int:
    side = max(round(px / (patch * merge)), 1) * patch * merge  # Qwen2-VL's smart_resize for a square image
    return (side // patch) ** 2


def shapes() -> list[Shape]:
    out = []
    for model, default in (("whisper-tiny.en", (384, 6, 1536)), ("whisper-base", (512, 8, 2048))):
        c = _config(model)
        d, h, ffn = (
            c.get("d_model", default[0]),
            c.get("encoder_attention_heads", default[1]),
            c.get("encoder_ffn_dim", default[2]),
        )
        s = c.get("max_source_positions", 1500)
        out.append(Shape(model, 1, s, h, d // h, None, (s, d, ffn)))
    for model in ("tiny-llava", "llava-smollm2"):
        v = _config(model).get("vision_config", {})
        d, h, ffn = v.get("hidden_size", 64), v.get("num_attention_heads", 2), v.get("intermediate_size", 128)
        side = v.get("image_size", 64) // v.get("patch_size", 16)
        s = side * side + 1  # + the class token; CLIP resizes any image to image_size
        out.append(Shape(model, 1, s, h, d // h, None, (s, d, ffn)))
    v = _config("tiny-qwen2-vl").get("vision_config", {})
    d, h = v.get("embed_dim", 64), v.get("num_heads", 2)
    ffn = int(d * v.get("mlp_ratio", 2))
    patch, merge = v.get("patch_size", 14), v.get("spatial_merge_size", 2)
    s = _qwen2_vl_patches(BENCH_IMAGE_PX, patch, merge)
    out.append(Shape("tiny-qwen2-vl", 1, s, h, d // h, (0, s), (s, d, ffn)))
    n = _qwen2_vl_patches(448, patch, merge)
    out.append(Shape("tiny-qwen2-vl-2x448px", 1, 2 * n, h, d // h, (0, n, 2 * n), (2 * n, d, ffn)))
    return out


def _timed(fn, min_s: float = 0.05) -> float:
    """Seconds per call: as many calls as fill ``min_s`` (at least one), after one warm-up call."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s:
            return elapsed / n


def gemm_fns(m: int, k: int, n: int) -> dict[str, object]:
    """fc1 through vLLM's oneDNN handlers, per dtype (``int8``: bf16 activations quantised per token inside)."""
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    fns = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # [K, N] views of [N, K] weights, as vLLM hands Linear weights to oneDNN
        x, w = torch.randn((m, k), generator=gen).to(dt), torch.randn((n, k), generator=gen).to(dt).t()
        handler = ops.create_onednn_mm(w, 32)
        fns[name] = lambda h=handler, x=x: ops.onednn_mm(h, x, None)
    x = torch.randn((m, k), generator=gen).to(torch.bfloat16)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen).t()
    scales = torch.rand((n, 1), generator=gen, dtype=torch.float32) / 100
    handler = ops.create_onednn_scaled_mm(w, scales, torch.bfloat16, True, False, 32)

    def int8(h=handler, x=x):
        x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((m, n), dtype=torch.bfloat16)
        ops.onednn_scaled_mm(h, x_q, out, x_s, None, None, None)
        return out

    fns["int8"] = int8
    return fns


def measure(
    reps: int = 5, names: list[str] | None = None, dtypes: tuple[str, ...] = ("float32", "bfloat16"), log=print
) -> dict:
    from mmcpu_dev.bench.runners import CpuWatch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1)
    record = {
        "cpu": cpu.current().as_dict(),
        "vllm_c": cpu.loaded_vllm_c(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "reps": reps,
        "shapes": {},
    }
    for shape in shapes():
        if names and shape.name not in names:
            continue
        watch = CpuWatch()
        row: dict = {"shape": asdict(shape), "gflop": round(shape.flops / 1e9, 4)}
        gemm = gemm_fns(*shape.fc1)
        gemm_flop = 2.0 * shape.fc1[0] * shape.fc1[1] * shape.fc1[2]
        cu = torch.tensor(shape.cu_seqlens, dtype=torch.int32) if shape.cu_seqlens else None
        for dt_name in dtypes:
            dt = getattr(torch, dt_name)
            gen = torch.Generator().manual_seed(1)
            # q, k, v as the models hand them over: views of one fused qkv projection output.
            qkv = torch.randn((shape.b, shape.s, 3 * shape.heads * shape.head_size), generator=gen).to(dt)
            q, k, v = (x.view(shape.b, shape.s, shape.heads, shape.head_size) for x in qkv.chunk(3, dim=-1))
            impls = [
                i
                for i in attention.IMPLS
                if attention.self_check(i, dt, shape.head_size, shape.heads, shape.heads) is None
                or i.startswith("sdpa")
            ]
            fns = {i: (lambda i=i: attention.encoder_attention(q, k, v, None, cu, impl=i)) for i in impls}  # noqa: B023
            fns["auto"] = lambda: attention.encoder_attention(q, k, v, None, cu)  # noqa: B023
            fns["gemm"] = gemm[dt_name]
            times: dict[str, list[float]] = {i: [] for i in fns}
            for _ in range(reps):  # interleaved: each round times every implementation once
                for i, fn in fns.items():
                    times[i].append(_timed(fn))
            gf = {
                i: _sig((gemm_flop if i == "gemm" else shape.flops) / statistics.median(t) / 1e9)
                for i, t in times.items()
            }
            gf["ratio"] = _sig(gf["auto"] / gf["gemm"])
            cuts = shape.cu_seqlens or (0, shape.s)
            longest = max(y - x for x, y in zip(cuts, cuts[1:], strict=False))
            gf["auto_is"] = (
                "sdpa_strided"
                if longest * longest < attention.MIN_WORK
                else attention.choose(dt, shape.head_size, shape.heads, shape.heads)
            )
            row[dt_name] = gf
        if "bfloat16" in dtypes:
            t = [_timed(gemm["int8"]) for _ in range(reps)]
            g8 = _sig(gemm_flop / statistics.median(t) / 1e9)
            row["int8"] = {"attention": "bfloat16", "gemm": g8, "ratio": _sig(row["bfloat16"]["auto"] / g8)}
        row["load"] = watch.stop()
        record["shapes"][shape.name] = row
        log(_line(shape.name, row))
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return record


def _sig(x: float) -> float:
    """4 significant digits: the vision fixtures' rates are well under 1 GFLOP/s."""
    return float(f"{x:.4g}")


def _line(name: str, row: dict) -> str:
    parts = [f"{name} ({row['gflop']} GFLOP)"]
    for dt in ("float32", "bfloat16"):
        if dt in row:
            r = row[dt]
            impls = " ".join(f"{i} {r[i]}" for i in (*attention.IMPLS, "auto") if i in r)
            parts.append(f"{dt}: {impls}; gemm {r['gemm']}, ratio {r['ratio']} ({r['auto_is']})")
    if "int8" in row:
        parts.append(f"int8: gemm {row['int8']['gemm']}, ratio {row['int8']['ratio']}")
    load = row["load"]
    parts.append(f"load {load['loadavg_1m']}, foreign cores {load['foreign_cores']}")
    return " | ".join(parts)


def headline(reps: int = 3) -> dict:
    """``{shape: {impl: bf16 GFLOP/s}, "gemm_bf16": ..., "ratio": ...}`` (see the module docstring)."""
    record = measure(reps, dtypes=("bfloat16",), log=lambda _: None)
    out: dict = {}
    for name, row in record["shapes"].items():
        out[name] = {i: g for i, g in row["bfloat16"].items() if i not in ("gemm", "ratio", "auto_is")}
    tiny = record["shapes"]["whisper-tiny.en"]["bfloat16"]
    out["gemm_bf16"], out["ratio"] = tiny["gemm"], tiny["ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench attention")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / ".cache" / "bench-attention" / "attention.json")
    args = parser.parse_args(argv)
    info = cpu.current()
    print(f"CPU: {info.line()}; torch {torch.__version__}; load {os.getloadavg()[0]:.2f}", flush=True)
    record = measure(
        args.reps, [n for n in args.shapes.split(",") if n] or None, log=lambda line: print(line, flush=True)
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
