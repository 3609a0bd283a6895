"""Fail at build and at start, not at a request: the installed vLLM's MRV2 kernels against our native versions.

:func:`run` imports the installed vLLM's MRV2 kernel modules and reports a :class:`Problem` for

- every kernel a serving request can reach (``reachability.KERNELS`` says ``native``) whose native version is
  missing or whose guard (argument names + source hash, :func:`mmcpu.kernels.dispatch.guard`) does not match:
  the dispatcher would leave it to Triton's interpreter, tens to thousands of times slower;
- every kernel the classification does not know (a vLLM other than the one it was read from): a request may
  reach it, and nobody has written or checked a native version for it.

``python -m mmcpu.kernels check`` prints one line per problem and exits 2 (the image build runs it,
docker/Dockerfile); it also fails when mmcpu's vLLM plugin entry point is not registered (:func:`plugin_problems`). The
engine's start (:func:`mmcpu.launch.preflight`) runs the same check through
:func:`cached`: importing vLLM's kernel modules costs ~10 s of CPU, so a run's result is kept in a stamp beside
the vLLM it checked (``vllm/.mmcpu-kernels-check.json``, like the patch tool's record) under a fingerprint of
every file the result depends on (vLLM's kernel modules and the files the guards read, mmcpu's kernels); a
start whose files are unchanged reads the stamp (milliseconds), any other start runs the check again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STAMP_NAME = ".mmcpu-kernels-check.json"
KERNELS_DIR = Path(__file__).resolve().parent  # mmcpu/kernels: the native versions, the guard, the classification


class CheckError(Exception):
    """The check could not run (no vLLM, no kernels found): one line."""


@dataclass(frozen=True)
class Problem:
    kernel: str  # "module:name"
    reason: str

    def line(self) -> str:
        return f"{self.kernel}: {self.reason}"


@dataclass(frozen=True)
class Result:
    problems: list[Problem]
    reachable: int  # kernels checked (classified reachable and present in the installed vLLM)
    files: list[str]  # source files the guards read, beyond reachability.scanned_files()


def vllm_dir() -> Path:
    """The installed ``vllm`` package directory, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise CheckError(f"vllm is not installed for {sys.executable}")
    return Path(spec.origin).resolve().parent


def run() -> Result:
    """The check itself: imports vLLM's MRV2 kernel modules (``TRITON_INTERPRET=1`` must be set before vLLM or
    triton is imported; the CLI sets it)."""
    from mmcpu.kernels import dispatch, reachability

    kernels = reachability.installed_kernels()
    if not kernels:
        raise CheckError(
            "no @triton.jit kernels found in vLLM's MRV2 modules: TRITON_INTERPRET=1 must be set "
            "before vLLM is imported, and vLLM must carry patches/0004"
        )
    dispatch.load_native_modules()
    problems, files = [], set()
    for key in sorted(set(kernels) - set(reachability.KERNELS)):
        problems.append(
            Problem(
                key,
                "not classified in mmcpu/kernels/reachability.py (new in this vLLM?): a "
                "request may reach it and no native version was checked against it",
            )
        )
    checked = 0
    for key in reachability.reachable():
        kernel = kernels.get(key)
        if kernel is None:  # not in this vLLM: nothing to launch (tests/kernels/test_inventory.py flags the list)
            continue
        checked += 1
        files |= dispatch.kernel_source_files(kernel.fn)
        entry, why = dispatch.guard(kernel.fn, kernel.arg_names)
        if entry is None:
            problems.append(Problem(key, f"{why}; it would run in Triton's interpreter"))
    scanned = {str(p) for p in reachability.scanned_files(vllm_dir())}
    return Result(problems, checked, sorted(files - scanned))


def plugin_problems() -> list[Problem]:
    """vLLM installs the native kernels only through our ``vllm.general_plugins`` entry point (mmcpu.plugin): it
    must be registered, i.e. mmcpu installed as a distribution (pip install), not only importable. Not part of
    the stamp's fingerprint (a reinstall changes it without changing a file the stamp covers), so the CLI writes
    no stamp while it is missing."""
    from importlib.metadata import entry_points

    found = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "mmcpu"]
    if found == ["mmcpu.plugin:register"]:
        return []
    return [
        Problem(
            "mmcpu.plugin:register",
            f"vllm.general_plugins entry point 'mmcpu' is {found or 'missing'}: "
            "vLLM would not install the native kernels (pip install mmcpu)",
        )
    ]


def fingerprint(vdir: Path, extra_files: list[str]) -> str:
    """SHA-256 over every file a check's result depends on: vLLM's scanned kernel modules (a new kernel file or a
    new kernel shows here), ``extra_files`` (other sources the guards read) and mmcpu's kernels package."""
    from mmcpu.kernels import reachability

    files = {str(p) for p in reachability.scanned_files(vdir)} | set(extra_files)
    files |= {str(p) for p in KERNELS_DIR.rglob("*.py")}
    digest = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]}\n".encode())
    for name in sorted(files):
        try:
            content = hashlib.sha256(Path(name).read_bytes()).hexdigest()
        except OSError:
            content = "missing"
        digest.update(f"{name} {content}\n".encode())
    return digest.hexdigest()


def stamp_path(vdir: Path) -> Path:
    return vdir / STAMP_NAME


def write_stamp(vdir: Path, result: Result) -> bool:
    """Keep ``result`` for later starts; False when the vLLM dir is not writable (a non-root container)."""
    data = {
        "version": 1,
        "fingerprint": fingerprint(vdir, result.files),
        "files": result.files,
        "problems": [p.line() for p in result.problems],
        "reachable": result.reachable,
        "time": time.time(),
    }
    path = stamp_path(vdir)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def read_stamp(vdir: Path) -> list[str] | None:
    """The problem lines of the last check, if its files are unchanged since; else None."""
    try:
        data = json.loads(stamp_path(vdir).read_text())
        if data.get("version") == 1 and data["fingerprint"] == fingerprint(vdir, list(data["files"])):
            return [str(line) for line in data["problems"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def cached(timeout_s: float = 600, on_run: Callable[[], None] | None = None) -> tuple[list[str], str]:
    """(problem lines, how they were found) for the installed vLLM, for the engine's start: the stamp when the
    files are unchanged, else ``python -m mmcpu.kernels check`` in a subprocess (vLLM's ~1 GB of imports must not
    stay in the launcher, which lives as long as the engine); ``on_run`` is called before that."""
    try:
        vdir = vllm_dir()
    except CheckError as exc:
        return [str(exc)], "no vLLM"
    lines = read_stamp(vdir)
    if lines is not None:
        return lines, f"stamp {stamp_path(vdir)}"
    cmd = [sys.executable, "-m", "mmcpu.kernels", "check"]
    if on_run is not None:
        on_run()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"`{' '.join(cmd[1:])}` did not finish within {timeout_s:.0f} s"], "subprocess"
    if done.returncode == 0:
        return [], "subprocess"
    problems = [ln for ln in done.stdout.splitlines() if ln.strip()]
    if done.returncode != 2 or not problems:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        problems = [f"`python -m mmcpu.kernels check` failed (exit {done.returncode}): {last}"]
    return problems, "subprocess"
