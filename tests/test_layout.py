"""The runtime package and image hold no dev tooling (mmcpu_dev is neither in the wheel nor copied into the runtime
image): every module the image runs must import without it."""

from __future__ import annotations

import subprocess
import sys

RUNTIME_MODULES = [
    "mmcpu.launch",
    "mmcpu.gateway.app",
    "mmcpu.healthcheck",
    "mmcpu.patchtool",
    "mmcpu.proc",
    "mmcpu.kernels.dispatch",
    "mmcpu.kernels.check",
    "mmcpu.plugin",
    "mmcpu.cpu",
    "mmcpu.quantize",
    "mmcpu.config",
]

BLOCK_DEV = """
import importlib.abc, sys
class BlockDev(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mmcpu_dev" or name.startswith("mmcpu_dev."):
            raise ImportError(f"runtime imported {name}")
sys.meta_path.insert(0, BlockDev())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_DEV + code], capture_output=True, text=True, timeout=300)


def test_runtime_modules_import_without_the_dev_package():
    result = run_blocked("\n".join(f"import {m}" for m in RUNTIME_MODULES))
    assert result.returncode == 0, result.stderr


def test_the_blocker_would_catch_a_dev_import():
    result = run_blocked("import mmcpu_dev.payloads")
    assert result.returncode != 0 and "runtime imported mmcpu_dev" in result.stderr


def test_the_wheel_holds_the_runtime_package_only(tmp_path):
    """What `pip install .` puts in the image: mmcpu and its data, no mmcpu_dev."""
    import shutil

    from mmcpu.config import REPO_ROOT

    src, out = tmp_path / "src", tmp_path / "wheel"  # built from a copy: setuptools writes build/ beside the sources
    shutil.copytree(
        REPO_ROOT, src, ignore=shutil.ignore_patterns(".cache", ".git", "build", "*.egg-info", "__pycache__", "*.whl")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    import zipfile

    [wheel] = out.glob("mmcpu-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("mmcpu/launch.py") for n in names) and "mmcpu/cpu_defaults.json" in names
    assert not [n for n in names if n.startswith("mmcpu_dev/")], "the wheel carries the dev tooling"
