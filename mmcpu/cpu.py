"""Which CPU this is and how much of it a process gets.

What it is: model, the ISA flags that decide vLLM's kernels and dtypes, and which ``_C`` build of vLLM a process
loaded. Machines of one kind come with different CPUs (Intel Xeon with AVX-512 + AMX, AMD EPYC with AVX2 only, AMD
EPYC with AVX-512 but no AMX), so every log and benchmark that quotes a figure says which.

How much: :class:`Cpus` (the affinity and the cgroup CPU quota an engine computes within) and the cgroup memory
limit, which the launcher sizes vLLM's threads and caches from.

``python -m mmcpu.cpu`` prints it as JSON.
"""

from __future__ import annotations

import json
import math
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
        return (
            f"{self.model} ({self.vendor} family {self.family}), {self.cpus} CPUs, isa {self.isa}: "
            f"{' '.join(self.flags) or 'none of ' + ' '.join(ISA_FLAGS)}"
        )

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


@dataclass(frozen=True)
class Cpus:
    """The CPUs an engine may compute on: its affinity (a container's cpuset) and its CPU quota (compose
    ``cpus:``, a Kubernetes CPU limit; None = no quota)."""

    allowed: tuple[int, ...]
    quota: float | None = None

    @classmethod
    def current(cls) -> Cpus:
        return cls(tuple(sorted(os.sched_getaffinity(0))), cgroup_cpu_quota())

    @property
    def count(self) -> int:
        """Whole CPUs to compute on: the quota rounded down (at least 1), at most the allowed ones."""
        n = len(self.allowed)
        return n if self.quota is None else max(1, min(n, math.floor(self.quota)))

    def split(self, parts: int) -> list[Cpus]:
        """The ``all`` role's engines: disjoint parts from 2 CPUs per engine up (each its own cores); below that
        they share every CPU (one engine alone on one of two cores would leave the other idle)."""
        if self.count < 2 * parts or parts == 1:
            return [self] * parts
        if self.quota is not None and self.quota < len(self.allowed):  # a quota over a shared pool: divide it
            return [Cpus(self.allowed, self.quota / parts)] * parts
        usable = self.allowed[: self.count]
        size = len(usable) // parts
        quota = None if self.quota is None else self.quota / parts
        return [Cpus(usable[i * size : (i + 1) * size if i < parts - 1 else None], quota) for i in range(parts)]


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of quota from cgroup v2 ``cpu.max`` (or v1 ``cpu.cfs_quota_us``); None when unlimited."""
    try:
        max_quota, max_period = (root / "cpu.max").read_text().split()[:2]
        return None if max_quota == "max" else int(max_quota) / int(max_period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of cgroup v2 ``memory.max`` (or v1 ``memory.limit_in_bytes``); None when unlimited."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        # v1 says "unlimited" with a huge number (PAGE_COUNTER_MAX pages), v2 with "max".
        return None if text == "max" or int(text) >= 1 << 60 else int(text)
    return None


def main() -> int:
    json.dump(current().as_dict(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
