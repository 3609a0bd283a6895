"""mmcpu.proc.stop_group on real process groups: the whole group goes, also when its leader exits first (vLLM's
API server dying and leaving its EngineCore behind) or when a member ignores SIGTERM."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from mmcpu.proc import stop_group


def start(script: str) -> tuple[subprocess.Popen, int]:
    """sh -c script in a new session; the script prints the pid of the member it leaves running."""
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    return proc, child


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("leader", ["exited", "running"])
def test_a_member_that_ignores_sigterm_is_killed(leader):
    """The leader goes on SIGTERM (or has gone already); its child ignores SIGTERM: SIGKILL after the timeout."""
    wait = "exit 0" if leader == "exited" else "wait"
    proc, child = start(f"(trap '' TERM; exec sleep 300) & echo $!; {wait}")
    if leader == "exited":
        proc.wait(timeout=10)
    t0 = time.monotonic()
    stop_group(proc, timeout_s=1)
    assert gone(child) and proc.poll() is not None
    assert time.monotonic() - t0 < 8


def test_a_member_left_by_an_exited_leader_gets_sigterm():
    """The leader exited before stop_group; its child still runs and stops on SIGTERM, well before the timeout."""
    proc, child = start("sleep 300 & echo $!; exit 0")
    proc.wait(timeout=10)
    t0 = time.monotonic()
    stop_group(proc, timeout_s=30)
    assert gone(child) and time.monotonic() - t0 < 10


def test_nothing_left_and_none():
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait(timeout=10)
    stop_group(proc, timeout_s=1)
    stop_group(None, timeout_s=1)
    assert proc.returncode == 0
