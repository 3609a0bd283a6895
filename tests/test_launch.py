"""mmcpu.launch's supervision, with real child processes and real signals.

The container's exit code is what Docker's restart policy acts on: an engine whose vLLM exits 0 without being
asked to (vLLM's API server does after EngineDeadError) must make the launcher exit non-zero; a requested stop
must exit 0 after the child drained; a child that ignores SIGTERM must not outlive its drain time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mmcpu import launch
from mmcpu.config import Settings


def supervisor(child: str, *, drain_s: float = 0, grace_s: float = 15) -> subprocess.Popen:
    """A launcher (in its own process, so it can take signals) supervising one python child running `child`."""
    code = textwrap.dedent(f"""
        import sys
        from mmcpu import launch
        launch.STARTUP_GRACE_S = {grace_s}
        sys.exit(launch.supervise([("audio", [sys.executable, "-c", {child!r}], None)], "audio", drain_s={drain_s}))
    """)
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)


def test_unrequested_exit_0_becomes_a_failure_with_a_reason():
    proc = supervisor("import time; time.sleep(0.5)")  # exits 0 by itself, like vLLM after EngineDeadError
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "[mmcpu] audio: audio exited with 0 without a stop request (its EngineCore died?); exiting 1" in err


def test_unrequested_crash_keeps_its_code():
    proc = supervisor("import sys; sys.exit(7)")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert "exited with 7 without a stop request" in err


def test_requested_stop_waits_for_the_child_and_exits_0():
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), print('drained', flush=True), sys.exit(0)))\n"
             "time.sleep(60)")
    proc = supervisor(child, drain_s=30)
    time.sleep(2)  # let the child install its handler
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM: stopping" in err
    assert 1.4 < time.monotonic() - t0 < 20


def test_child_ignoring_sigterm_is_killed_after_its_grace():
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    proc = supervisor(child, drain_s=0, grace_s=2)
    time.sleep(2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert "still running after its drain time; killing it" in err
    assert proc.returncode == 128 + signal.SIGKILL


@pytest.mark.parametrize("drain, expected", [(120, "120"), (7.2, "8")])
def test_engine_gets_vllm_shutdown_timeout_from_drain_s(drain, expected):
    argv = launch.engine_argv("/models/m", Settings(drain_s=drain), port=8001)
    assert argv[argv.index("--shutdown-timeout") + 1] == expected


def test_drain_0_keeps_vllms_abort_on_shutdown():
    assert "--shutdown-timeout" not in launch.engine_argv("/models/m", Settings(drain_s=0), port=8001)


def test_exit_status_of_a_signalled_child():
    assert launch.exit_status(-signal.SIGKILL) == 137
    assert launch.exit_status(3) == 3


def test_entrypoint_writes_the_role_for_the_healthcheck(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "run", lambda commands, role, settings, ports: seen.update(role=role) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    assert launch.entrypoint(["vision"]) == 0
    assert seen["role"] == "vision"
    assert (tmp_path / "role").read_text() == "vision"
