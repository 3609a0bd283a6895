"""Process trees: vLLM runs an API server, an EngineCore and workers below whatever started it. The launcher
(runtime) and the dev tooling (test/bench servers) stop and measure them with these helpers only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil


def tree(pid: int | None) -> list[psutil.Process]:
    """A process and all its descendants; [] if it is gone."""
    if not pid:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants."""
    for proc in tree(pid):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def tree_rss(pid: int | None) -> int:
    """RSS of a process and all its descendants, summed (shared pages count once per process); 0 if gone."""
    total = 0
    for proc in tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def stop_group(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Stop a child started with ``start_new_session=True`` and everything in its process group: SIGTERM, then
    SIGKILL to whatever of the group is left after ``timeout_s``. The group is stopped even when its leader has
    already exited: vLLM's API server can die and leave its EngineCore running in the group."""
    if not proc:
        return
    if not _signal_group(proc.pid, signal.SIGTERM):
        proc.poll()  # reap a leader that exited alone
        return
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    while _signal_group(proc.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)  # the leader has gone (and is reaped): its children are still shutting down
    if _signal_group(proc.pid, signal.SIGKILL):
        proc.wait(timeout=10)
        for _ in range(100):  # SIGKILL is asynchronous: let the members go before the caller reuses ports
            if not _signal_group(proc.pid, 0):
                break
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid`` (0 = only check); False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def exit_status(code: int) -> int:
    """A child's Popen return code as a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - code if code < 0 else code
