"""Which CPU this is: model, the ISA flags that decide vLLM's kernels and dtypes, and which ``_C`` build of vLLM
a process loaded. Machines of one kind come with different CPUs (Intel Xeon with AVX-512 + AMX, AMD EPYC with
AVX2 only, AMD EPYC with AVX-512 but no AMX), so every log and benchmark that quotes a figure says which.

``python -m mmcpu.cpu`` prints it as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# The flags that change what vLLM's CPU backend and oneDNN can run: AVX2/FMA (vLLM's _C_AVX2 build), AVX-512
# (_C_AVX512), bf16 and VNNI dot products, AMX tiles.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo "model name"
    vendor: str
    family: str
    cpus: int  # CPUs this process may run on (its affinity, e.g. a container's cpuset)
    flags: tuple[str, ...]  # the ISA_FLAGS this CPU has, in ISA_FLAGS order

    @property
    def isa(self) -> str:
        """The class the per-CPU defaults are keyed by: ``amx``, ``avx512_bf16``, ``avx512`` or ``avx2``."""
        have = set(self.flags)
        if {"amx_tile", "amx_bf16"} <= have:
            return "amx"
        if {"avx512f", "avx512_bf16"} <= have:
            return "avx512_bf16"
        if "avx512f" in have:
            return "avx512"
        return "avx2" if "avx2" in have else "baseline"

    def line(self) -> str:
        return (f"{self.model} ({self.vendor} family {self.family}), {self.cpus} CPUs, isa {self.isa}: "
                f"{' '.join(self.flags) or 'none of ' + ' '.join(ISA_FLAGS)}")

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "isa": self.isa}


def parse_cpuinfo(text: str, cpus: int) -> CpuInfo:
    """The first processor block of a /proc/cpuinfo text (all blocks describe the same CPU model here)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    have = set(fields.get("flags", "").split())
    return CpuInfo(
        model=fields.get("model name", "unknown"),
        vendor=fields.get("vendor_id", "unknown"),
        family=fields.get("cpu family", "?"),
        cpus=cpus,
        flags=tuple(f for f in ISA_FLAGS if f in have),
    )


def current(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    try:
        text = path.read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, len(os.sched_getaffinity(0)))


def loaded_vllm_c(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """File names of vLLM's native op libraries mapped into this process (``_C_AVX512.abi3.so``, ...): which
    build vLLM picked at run time. Empty before vLLM loaded one."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    names = set()
    for line in text.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "/vllm/" in path and Path(path).name.startswith("_C") and path.endswith(".so"):
            names.add(Path(path).name)
    return sorted(names)


def main() -> int:
    json.dump(current().as_dict(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
