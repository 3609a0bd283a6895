"""The runtime image removes mmcpu.dev (docker/Dockerfile): every module the image runs must import without it."""

from __future__ import annotations

import subprocess
import sys

RUNTIME_MODULES = ["mmcpu.launch", "mmcpu.gateway.app", "mmcpu.healthcheck", "mmcpu.patchtool", "mmcpu.proc",
                   "mmcpu.kernels.dispatch", "mmcpu.kernels.check", "mmcpu.plugin", "mmcpu.cpu", "mmcpu.quantize",
                   "mmcpu.config"]

BLOCK_DEV = """
import importlib.abc, sys
class BlockDev(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mmcpu.dev" or name.startswith("mmcpu.dev."):
            raise ImportError(f"runtime imported {name}")
sys.meta_path.insert(0, BlockDev())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_DEV + code], capture_output=True, text=True, timeout=300)


def test_runtime_modules_import_without_the_dev_package():
    result = run_blocked("\n".join(f"import {m}" for m in RUNTIME_MODULES))
    assert result.returncode == 0, result.stderr


def test_the_blocker_would_catch_a_dev_import():
    result = run_blocked("import mmcpu.dev.payloads")
    assert result.returncode != 0 and "runtime imported mmcpu.dev" in result.stderr
