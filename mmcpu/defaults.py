"""Each engine's dtype and quantisation, chosen per CPU from a measured table.

Machines of one kind come with different CPUs, and what is fastest differs between them (bf16 is emulated without
avx512_bf16/AMX; int8 GEMMs gain little on AVX2). ``cpu_defaults.json`` holds one row per ISA class
(:attr:`mmcpu.cpu.CpuInfo.isa`): the audio and vision roles' choice, and where it came from. A measured row is
written by ``python -m mmcpu_dev.bench defaults`` on a CPU of that class, with every candidate's figures and the
rule that picked the winner (``mmcpu_dev.bench.rule``; the runtime only reads the table); a row nobody could measure
says so and why it holds what it holds.

Settings override the table: ``MMCPU_DTYPE`` (every engine) and ``MMCPU_QUANTIZATION`` (Whisper engines: ``none``
serves the float checkpoint, ``int8`` the int8 one beside it, ``<model>-int8``, made by ``mmcpu-quantize``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from mmcpu import cpu

TABLE_PATH = Path(__file__).with_name("cpu_defaults.json")
ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "baseline")
BF16_ISAS = ("amx", "avx512_bf16")  # bf16 in hardware; elsewhere it is emulated (whisper-base 4.3x slower on AVX2)
Quantization = Literal["none", "int8"]
INT8_SUFFIX = "-int8"  # mmcpu-quantize's DST for the image's and the README's checkpoints: <model>-int8


class Choice(BaseModel):
    dtype: str  # vLLM --dtype: float32, bfloat16, auto
    quantization: Quantization = "none"


class Candidate(BaseModel):
    """One measured configuration of a role: its figures on the benchmark's fixed workload."""

    choice: Choice
    throughput: dict[int, float]  # concurrency -> audio-s/s (audio) or requests/s (vision)
    wer: float | None = None  # audio only
    error: str | None = None  # the candidate could not serve the workload (e.g. its engine died): never picked


class Row(BaseModel):
    audio: Choice
    vision: Choice
    measured_on: str | None = None  # the CPU (model, ISA flags) the candidates ran on; None: not measured
    date: str | None = None
    evidence: str  # what the row rests on; for an unmeasured row, why it holds what it holds
    candidates: dict[str, list[Candidate]] = {}  # role -> what was measured (empty when not measured)


class Table(BaseModel):
    rule: str
    rows: dict[str, Row]


@lru_cache(maxsize=1)
def table() -> Table:
    return Table.model_validate_json(TABLE_PATH.read_text())


def row(info: cpu.CpuInfo | None = None) -> tuple[str, Row]:
    isa = (info or cpu.current()).isa
    return isa, table().rows[isa]


def is_quantized(model: Path) -> bool:
    try:
        return bool(json.loads((model / "config.json").read_text()).get("quantization_config"))
    except (OSError, ValueError):
        return False


def int8_sibling(model: str) -> Path | None:
    """The int8 checkpoint beside a local float one (``<model>-int8``), if there is one."""
    path = Path(model)
    sibling = path.with_name(path.name + INT8_SUFFIX)
    return sibling if path.is_dir() and (sibling / "config.json").is_file() and is_quantized(sibling) else None


class Resolved(BaseModel):
    model: str  # the checkpoint to load (the int8 sibling when int8 was chosen)
    dtype: str
    quantization: Quantization
    why: str  # for the log: where the choice came from

    def line(self, role: str) -> str:
        return f"[mmcpu] {role}: dtype {self.dtype}, quantization {self.quantization} ({self.model}): {self.why}"


class Refused(ValueError):
    """An explicit setting that cannot be honoured: the launcher exits 2 with this one line."""


def resolve(
    role: str,
    model: str,
    *,
    dtype: str | None,
    quantization: str,
    speech: bool,
    apply_table_quantization: bool = True,
    interpreter: bool = False,
    info: cpu.CpuInfo | None = None,
) -> Resolved:
    """What an engine of ``role`` (audio / vision) serving ``model`` runs with. ``dtype`` / ``quantization`` are
    MMCPU_DTYPE / MMCPU_QUANTIZATION (None / "auto": the table's). Quantisation applies to Whisper (``speech``)
    checkpoints only, the one int8 path this project tests; ``apply_table_quantization=False`` (mmcpu-serve: it
    serves the checkpoint it is given) takes int8 only when asked for explicitly. ``interpreter``
    (MMCPU_KERNELS=interpreter, which cannot compute in bfloat16) turns a table dtype other than float32 into
    float32; an explicit MMCPU_DTYPE stays as given."""
    isa, r = row(info)
    choice: Choice = getattr(r, role)
    source = f"per-CPU default for isa {isa}" + (
        f" (measured on {r.measured_on}, {r.date})" if r.measured_on else " (not measured on this kind of CPU)"
    )
    dwhy = "dtype from MMCPU_DTYPE" if dtype else "dtype: " + source
    dtype_from_row = not dtype
    table_dtype = choice.dtype
    if interpreter and not dtype and table_dtype != "float32":
        table_dtype, dtype_from_row = "float32", False
        dwhy = f"dtype float32: MMCPU_KERNELS=interpreter (the table's {choice.dtype} is not possible there)"
    quant_from_row = False
    if quantization == "auto":
        wanted: str = choice.quantization if apply_table_quantization and speech else "none"
        quant_from_row = wanted == choice.quantization
        qwhy = "quantization: " + source if quant_from_row else "quantization: the model as given"
    else:
        wanted, qwhy = quantization, "quantization from MMCPU_QUANTIZATION"
    if wanted == "int8" and not speech:  # only an explicit int8 gets here ("auto" stays "none" for them)
        raise Refused(f"MMCPU_QUANTIZATION=int8 applies to Whisper checkpoints only; {model} is not one")
    served = model
    if is_quantized(Path(model)):
        if quantization == "none":
            raise Refused(
                f"MMCPU_QUANTIZATION=none, but {model} is itself a quantised checkpoint; serve its float "
                "original instead"
            )
        wanted, qwhy, quant_from_row = "int8", "quantization: the checkpoint is quantised", False
    elif wanted == "int8":
        sibling = int8_sibling(model)
        if sibling is not None:
            served = str(sibling)
        elif quantization == "int8":
            raise Refused(
                f"MMCPU_QUANTIZATION=int8, but there is no int8 checkpoint beside {model} "
                f"(make one: mmcpu-quantize {model} {model}{INT8_SUFFIX})"
            )
        else:
            wanted, quant_from_row = "none", False
            qwhy = f"quantization none: the default is int8, but no {Path(model).name}{INT8_SUFFIX}"
    # both from the row: say where once
    why = "dtype and quantization: " + source if dtype_from_row and quant_from_row else f"{dwhy}; {qwhy}"
    return Resolved(model=served, dtype=dtype or table_dtype, quantization=wanted, why=why)
