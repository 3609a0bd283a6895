"""``mmcpu-quantize SRC DST``: a W8A8 int8 copy of a Whisper checkpoint for vLLM's CPU int8 path.

SRC is a transformers ``WhisperForConditionalGeneration`` folder (tiny ... large-v3); DST gets the same model in the
compressed-tensors ``int-quantized`` format, which vLLM loads through ``CompressedTensorsW8A8Int8`` and runs on CPU
with ``CPUInt8ScaledMMLinearKernel`` (oneDNN ``onednn_scaled_mm``: AMX, AVX-512 VNNI or AVX2, oneDNN picks):

- every ``nn.Linear`` of the encoder and decoder layers (q/k/v/out projections, cross-attention, fc1, fc2): weights
  int8, symmetric, one scale per output channel;
- their input activations int8, symmetric: ``dynamic`` = one scale per token computed at run time (no calibration),
  ``static`` = one scale per layer, the absolute maximum of that layer's input while the float model transcribes the
  ``--calibration`` clips (greedy, in transformers);
- convolutions, embeddings, layer norms and ``proj_out`` (tied to the token embedding) stay float, in SRC's dtype.

The checkpoint is built with the ``compressed-tensors`` library (the format's own code: QuantizationScheme,
apply_quantization_config, calculate_qparams, ModelCompressor), never by hand; DST also gets ``mmcpu-quantize.json``
(what was done, from which weights). Serve it like the float model: ``mmcpu-serve --model DST``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

ACTIVATIONS = ("dynamic", "static")
TARGETS = ["Linear"]  # compressed-tensors targets: module class names (vLLM: LinearBase layers of the same names)
IGNORE = ["proj_out"]  # the output projection, tied to the token embedding: stays float like the embedding
FORMAT = "int-quantized"
SAMPLE_RATE = 16000  # Whisper's feature extractor
CALIBRATION_MAX_NEW_TOKENS = 128
# Bump when the output for the same inputs changes (DST's mmcpu-quantize.json records it).
REVISION = 1
METADATA = "mmcpu-quantize.json"  # written last: its presence means DST is complete
# Files of SRC that are the weights or that DST gets anew; every other top-level file (tokenizer, processor,
# README, ...) is copied as it is.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".index.json")
_REWRITTEN = {"config.json", "generation_config.json", METADATA, "mmcpu-fixture.json"}


class QuantizeError(ValueError):
    """Bad input (not a Whisper checkpoint, unreadable clip, ...): one line for the user."""


def _log(msg: str) -> None:
    print(f"[mmcpu-quantize] {msg}", file=sys.stderr, flush=True)


# --- the scheme ------------------------------------------------------------------------------------
def scheme(activations: str) -> Any:
    """The compressed-tensors QuantizationScheme: int8 weights per channel, int8 inputs per token (dynamic) or per
    tensor (static), all symmetric: what vLLM's CPU int8 kernel implements."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    if activations not in ACTIVATIONS:
        raise QuantizeError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
    dynamic = activations == "dynamic"
    return QuantizationScheme(
        targets=list(TARGETS),
        weights=QuantizationArgs(
            num_bits=8, type=QuantizationType.INT, strategy=QuantizationStrategy.CHANNEL, symmetric=True, dynamic=False
        ),
        input_activations=QuantizationArgs(
            num_bits=8,
            type=QuantizationType.INT,
            symmetric=True,
            dynamic=dynamic,
            strategy=QuantizationStrategy.TOKEN if dynamic else QuantizationStrategy.TENSOR,
        ),
    )


def quantization_config(activations: str) -> Any:
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": scheme(activations)}, ignore=list(IGNORE), format=FORMAT)


def select_layers(model: torch.nn.Module) -> list[str]:
    """Names of the modules the scheme quantises (compressed-tensors' own matching of TARGETS less IGNORE)."""
    from compressed_tensors.utils.match import match_named_modules

    return [name for name, _ in match_named_modules(model, TARGETS, IGNORE)]


def weight_scales(weight: torch.Tensor, args: Any) -> torch.Tensor:
    """Per-output-channel scales of ``weight`` [N, K] -> [N, 1] float32 (compressed-tensors' calculate_qparams:
    symmetric, absmax / 127.5, zero rows get the smallest positive scale)."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.detach().to(torch.float32)
    scale, _zp = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    return scale.to(torch.float32)


def input_scale(absmax: float, args: Any) -> torch.Tensor:
    """The static per-tensor input scale [1] for an observed absolute maximum."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    m = torch.tensor([float(absmax)], dtype=torch.float32)
    scale, _zp = calculate_qparams(-m, m, args)
    return scale.reshape(1).to(torch.float32)


# --- inputs ----------------------------------------------------------------------------------------
def check_source(src: Path) -> dict[str, Any]:
    """SRC's config.json if SRC is a float transformers Whisper checkpoint folder, else QuantizeError."""
    if not src.exists():
        raise QuantizeError(f"{src}: no such folder")
    if not src.is_dir():
        raise QuantizeError(f"{src}: not a folder (SRC is a transformers Whisper checkpoint folder)")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise QuantizeError(f"{src}: no config.json (SRC is a transformers Whisper checkpoint folder)")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuantizeError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("model_type") != "whisper":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise QuantizeError(f"{src}: model_type {kind!r}, not a Whisper checkpoint")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise QuantizeError(f"{src}: already quantised ({method}); quantise the float checkpoint")
    if not weight_files(src):
        raise QuantizeError(f"{src}: no weights (*.safetensors or pytorch_model.bin)")
    return config


def weight_files(src: Path) -> list[Path]:
    files = sorted(src.glob("*.safetensors"))
    return files or sorted(p for p in src.glob("pytorch_model*.bin"))


def load_audio(path: Path) -> Any:
    """A clip as float32 mono at 16 kHz (numpy)."""
    import numpy as np
    import soundfile

    if not path.is_file():
        raise QuantizeError(f"calibration clip {path}: no such file")
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:
        raise QuantizeError(f"calibration clip {path}: not readable audio ({str(exc).splitlines()[0]})") from None
    audio = data.mean(axis=1)
    if audio.size == 0:
        raise QuantizeError(f"calibration clip {path}: no samples")
    if rate != SAMPLE_RATE:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(int(rate), SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // g, int(rate) // g).astype(np.float32)
    return audio


def sha256_files(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


# --- calibration -----------------------------------------------------------------------------------
def calibrate(
    model: torch.nn.Module, src: Path, clips: Sequence[tuple[str, Any]], layers: Sequence[str]
) -> dict[str, float]:
    """Absolute maximum of each layer's input while the float ``model`` transcribes ``clips`` ((name, 16 kHz
    audio) pairs; greedy, one at a time: the encoder over the padded 30 s window, the decoder over the tokens it
    generates)."""
    import torch
    import transformers
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(str(src))
    absmax = dict.fromkeys(layers, 0.0)
    modules = dict(model.named_modules())

    def hook(name: str):
        def record(_module: torch.nn.Module, args: tuple) -> None:
            absmax[name] = max(absmax[name], float(args[0].detach().abs().max()))

        return record

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in layers]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate()'s deprecation notes are not the user's business
    try:
        with torch.inference_mode():
            for name, audio in clips:
                features = extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
                tokens = model.generate(
                    features.to(model.dtype), max_new_tokens=CALIBRATION_MAX_NEW_TOKENS, do_sample=False
                )
                _log(f"calibrated on {name}: {tokens.shape[-1]} tokens")
    finally:
        transformers.logging.set_verbosity(verbosity)
        for handle in handles:
            handle.remove()
    unseen = [name for name, value in absmax.items() if value == 0.0]
    if unseen:
        raise QuantizeError(f"calibration never reached {len(unseen)} layers (e.g. {unseen[0]})")
    return absmax


# --- the tool --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    dst: Path
    layers: list[str]
    activations: str
    input_absmax: dict[str, float] | None  # static only


def quantize(
    src: Path, dst: Path, *, activations: str = "dynamic", calibration: Sequence[Path] = (), force: bool = False
) -> Result:
    """Write the int8 checkpoint of ``src`` to ``dst`` (see the module docstring); returns what it did."""
    src, dst = Path(src), Path(dst)
    if activations not in ACTIVATIONS:
        raise QuantizeError(f"--activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
    if activations == "static" and not calibration:
        raise QuantizeError("--activations static needs --calibration WAV... (a few clips of speech)")
    if activations == "dynamic" and calibration:
        raise QuantizeError("--calibration is for --activations static (dynamic scales need no calibration)")
    config = check_source(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not force:
            raise QuantizeError(f"{dst} exists (choose another DST, or --force to replace it)")
        if dst.resolve() == src.resolve():
            raise QuantizeError("DST is SRC")
    calibration = [Path(c) for c in calibration]
    audios = [(c.name, load_audio(c)) for c in calibration]  # all read first: a bad clip fails before any compute

    import torch
    from compressed_tensors import __version__ as ct_version
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import WhisperForConditionalGeneration

    save_dtype = _source_dtype(config)
    _log(f"loading {src} ({save_dtype})")
    model = WhisperForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    layers = select_layers(model)
    if not layers:
        raise QuantizeError(f"{src}: no linear layer to quantise")
    absmax = calibrate(model, src, audios, layers) if activations == "static" else None

    qconfig = quantization_config(activations)
    apply_quantization_config(model, qconfig)
    modules = dict(model.named_modules())
    quantised = [name for name in layers if getattr(modules[name], "quantization_scheme", None) is not None]
    if quantised != layers:
        raise RuntimeError(f"compressed-tensors quantised {len(quantised)} layers, expected {len(layers)}")
    with torch.no_grad():
        for name in layers:
            module = modules[name]
            args = module.quantization_scheme
            module.weight_scale.data.copy_(weight_scales(module.weight, args.weights))
            if absmax is not None:
                module.input_scale.data.copy_(input_scale(absmax[name], args.input_activations))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    compressor.compress_model(model)
    # Float tensors go back to SRC's dtype; int8 weights stay int8 and the scales float32 (what vLLM loads).
    for pname, param in model.named_parameters():
        if param.is_floating_point() and not pname.endswith("_scale"):
            param.data = param.data.to(save_dtype)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.config.dtype = save_dtype
        model.save_pretrained(str(tmp))
        compressor.update_config(str(tmp))
        for path in sorted(src.iterdir()):
            if path.is_file() and path.name not in _REWRITTEN and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, tmp / path.name)
        if not (tmp / "generation_config.json").exists() and (src / "generation_config.json").exists():
            shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
        meta = {
            "tool": "mmcpu-quantize",
            "revision": REVISION,
            "compressed_tensors": ct_version,
            "source": str(src.resolve()),
            "source_sha256": sha256_files(weight_files(src)),
            "format": FORMAT,
            "weights": "int8 symmetric per output channel",
            "activations": activations,
            "input_scales": (
                "int8 symmetric per token, at run time"
                if activations == "dynamic"
                else "int8 symmetric per tensor, absmax over the calibration clips"
            ),
            "calibration": [{"name": c.name, "sha256": sha256_files([c])} for c in calibration],
            "layers": layers,
            "float": ["conv1", "conv2", "embed_positions", "embed_tokens", "layer norms", *IGNORE],
        }
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        _publishable(tmp)
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(
        f"wrote {dst}: {len(layers)} linear layers int8 (W8A8, activations {activations}), "
        f"{sum(p.stat().st_size for p in dst.glob('*.safetensors')) / 2**20:.1f} MiB of weights"
    )
    return Result(dst, layers, activations, absmax)


def is_current(dst: Path, src: Path, *, activations: str, calibration: Sequence[Path] = ()) -> bool:
    """Whether ``dst`` is this revision's quantisation of ``src``'s current weights with these options."""
    try:
        meta = json.loads((Path(dst) / METADATA).read_text())
    except (OSError, ValueError):
        return False
    return (
        meta.get("revision") == REVISION
        and meta.get("activations") == activations
        and meta.get("source_sha256") == sha256_files(weight_files(Path(src)))
        and [c.get("sha256") for c in meta.get("calibration", [])] == [sha256_files([Path(c)]) for c in calibration]
    )


def _publishable(folder: Path) -> None:
    """mkdtemp's 0700 (and any 0600 file) -> the umask's usual modes: a model folder is read by other users
    (the image's runtime user)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _source_dtype(config: dict[str, Any]) -> torch.dtype:
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="mmcpu-quantize",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="e.g. mmcpu-quantize whisper-large-v3 whisper-large-v3-int8",
    )
    parser.add_argument("src", type=Path, metavar="SRC", help="a transformers Whisper checkpoint folder (float)")
    parser.add_argument("dst", type=Path, metavar="DST", help="the folder to write (must not exist, or --force)")
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="dynamic",
        help="int8 input scales: per token at run time (dynamic, default) or per layer, "
        "calibrated on --calibration clips (static)",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        nargs="+",
        default=[],
        metavar="WAV",
        help="speech clips for --activations static (any rate, mono or not; a few will do)",
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    try:
        quantize(args.src, args.dst, activations=args.activations, calibration=args.calibration, force=args.force)
    except (QuantizeError, OSError) as exc:
        print(f"mmcpu-quantize: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
