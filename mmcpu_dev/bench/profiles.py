"""Where the time goes: py-spy profiles of the engine's worker (collapsed stacks -> kernels, launch sites, self
and vLLM frames) and the start-up stages read from a vLLM log. Pure functions over text."""

from __future__ import annotations

import datetime as dt
import re
import sys
from collections import Counter
from collections.abc import Sequence

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# py-spy names files relative to their sys.path entry ("triton/runtime/interpreter.py"); absolute paths also work.
_TRITON = re.compile(r"(^|/)triton/")
_VLLM = re.compile(r"(^|/)vllm/")
_INTERPRETER = "triton/runtime/interpreter.py"
NO_FRAME = ("<no Python frame>", "")


def _frame(text: str) -> tuple[str, str]:
    m = _FRAME.match(text.strip())
    if not m:
        return text.strip(), ""
    return m["func"], m["file"]


def _short(path: str) -> str:
    """site-packages/vllm/v1/x.py -> vllm/v1/x.py: the import path, not where the venv happens to live."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _name(func: str, path: str) -> str:
    return f"{func} ({_short(path)})" if path else func


def parse_pyspy_raw(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy ``--format raw`` (collapsed stacks: ``root;...;leaf COUNT``) -> [(frames root first, count)]."""
    stacks = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:120]!r}")
        # a sample can have no Python frame at all (the thread was in native code only): keep it in the total
        stacks.append(([_frame(f) for f in stack.split(";")] if stack else [NO_FRAME], int(count)))
    return stacks


def _is_kernel_file(path: str) -> bool:
    """Not Triton and not the standard library (the GridExecutor also calls inspect.* before the body)."""
    top = _short(path).split("/", 1)[0].removesuffix(".py")
    return bool(path) and not _TRITON.search(path) and top not in sys.stdlib_module_names


def launch_of(frames: Sequence[tuple[str, str]]) -> tuple[str, str | None] | None:
    """For a stack under Triton's interpreter: (the call site that launched the kernel, the ``@triton.jit``
    function whose Python body the interpreter's GridExecutor is running - None while the interpreter is still
    doing its launch work: argument conversion, patching ``tl``). None for a stack outside the interpreter."""
    if not any(_INTERPRETER in f for _, f in frames):
        return None
    site, in_triton = None, False
    for i, (func, path) in enumerate(frames):
        if _TRITON.search(path):
            in_triton = True
            if func.startswith("GridExecutor.") and i + 1 < len(frames) and _is_kernel_file(frames[i + 1][1]):
                return site or "an unknown call site", _name(*frames[i + 1])
        elif not in_triton:
            site = _name(func, path)
    return site or "an unknown call site", None


def profile_summary(text: str, top: int = 12) -> dict:
    """Where the samples went: share under Triton's interpreter, kernels by inclusive samples, Triton launches
    by call site (kernel body + launch work), Python frames by self samples (the leaf), vLLM frames inclusive."""
    stacks = parse_pyspy_raw(text)
    total = sum(c for _, c in stacks)
    kernels: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    vllm_incl: Counter[str] = Counter()
    interp = 0
    for frames, count in stacks:
        if any(_INTERPRETER in f for _, f in frames):
            interp += count
        launch = launch_of(frames)
        if launch:
            site, kernel = launch
            sites[site] += count
            kernels[kernel or f"interpreter launch work, called from {site}"] += count
        func, path = frames[-1]
        leaves[_name(func, path)] += count
        for name in {_name(fn, p) for fn, p in frames if _VLLM.search(p)}:
            vllm_incl[name] += count

    def table(counter: Counter[str]) -> list[dict]:
        return [{"frame": k, "samples": v, "share": v / total} for k, v in counter.most_common(top)]

    return {
        "samples": total,
        "interpreter_share": interp / total if total else None,
        "kernels": table(kernels),
        "launch_sites": table(sites),
        "self_frames": table(leaves),
        "vllm_inclusive": table(vllm_incl),
    }


# "(EngineCore pid=7) INFO 12-01 11:05:56 [core.py:116] ..." - the prefix is missing before vLLM sets it.
_STAMP = re.compile(r"^(?:\((?P<proc>\w+) pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) (?P<when>\d\d-\d\d \d\d:\d\d:\d\d) ")
# (stage, the marker that ends it): a predicate on (process, line), or "api-last" = the API server's last line
# before the EngineCore process's first (unprefixed) one - there the EngineCore is spawned. A stage begins where
# the one before ended.
STARTUP_STAGES = (
    ("imports, API server", lambda proc, text: proc == "APIServer"),
    ("config + tokenizer, API server", "api-last"),
    ("EngineCore spawn + imports", lambda proc, text: proc == "EngineCore"),
    (
        "device + worker init",
        lambda proc, text: "Loading model from scratch" in text or "Starting to load model" in text,
    ),
    ("model load", lambda proc, text: "Model loading took" in text),
    ("warm-up + profile + KV cache", lambda proc, text: "init engine (profile, create kv cache, warmup model)" in text),
)


def startup_breakdown(log: str, started_at: float, ready_s: float, year: int) -> dict[str, float]:
    """Seconds per start-up stage of one engine, from its log's (second-resolution, local-time) stamps:
    ``started_at`` = wall clock of the spawn, ``ready_s`` = spawn to /health 200. The last stage, "API ready",
    runs to ready. Stages whose marker is missing are left out (their time falls into the next one)."""
    stamped = [
        (m["proc"], line, dt.datetime.strptime(f"{year}-{m['when']}", "%Y-%m-%d %H:%M:%S").timestamp())
        for line in log.splitlines()
        if (m := _STAMP.match(line))
    ]
    marks: list[tuple[str, float]] = []
    i = 0
    for name, ends in STARTUP_STAGES:
        if ends == "api-last":
            # The first unprefixed line after the API server began: the EngineCore importing vLLM.
            j = next((k for k in range(i, len(stamped)) if stamped[k][0] is None), None)
            last = [k for k in range(i, j if j is not None else 0) if stamped[k][0] == "APIServer"]
            if not last:
                continue
            i = last[-1]
        else:
            j = next((k for k in range(i, len(stamped)) if ends(stamped[k][0], stamped[k][1])), None)
            if j is None:
                continue
            i = j
        marks.append((name, stamped[i][2]))
    out: dict[str, float] = {}
    previous = started_at
    for name, when in marks:
        out[name] = round(max(0.0, when - previous), 1)
        previous = max(previous, when)
    out["API ready"] = round(max(0.0, started_at + ready_s - previous), 1)
    return out
