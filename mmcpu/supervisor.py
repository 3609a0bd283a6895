"""The launcher's process supervisor and its per-engine watchdog: the container's processes run as children, and
the container's exit code says whether one died or hung (Docker's restart policy and the kubelet act on it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from mmcpu import health
from mmcpu.config import Settings
from mmcpu.proc import exit_status, kill_tree, listening

# Beyond the drain: time to exit after SIGTERM (and all of it for an engine still starting, which ignores SIGTERM).
STARTUP_GRACE_S = 15


class Process(NamedTuple):
    """One child: its name (an engine role, ``engine`` for mmcpu-serve, or ``gateway``), argv and environment
    (None: this process's)."""

    name: str
    argv: list[str]
    env: dict[str, str] | None


class Watchdog(threading.Thread):
    """Checks one engine child for progress every ``interval`` seconds, in a thread (a check may block for the
    probe's bound; the supervisor's loop must stay free for signals): the healthcheck's test
    (:func:`mmcpu.health.progress_check`: token counters moved, else a 1-token request finishes within
    ``probe_s``). ``verdict`` is set, and the thread ends, after ``failures`` failed checks in a row. Checks
    before the engine served its first request do not count (vLLM accepts connections while it is still loading),
    and until then only /health is asked."""

    def __init__(
        self,
        kind: str,
        port: int,
        *,
        interval: float,
        failures: int,
        timeout: float,
        probe_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(name=f"mmcpu-watchdog-{kind}", daemon=True)
        self.kind, self.port, self.interval, self.failures = kind, port, interval, failures
        self.timeout, self.probe_s = timeout, probe_s
        self.headers = headers or {}  # the engine's internal key (health.engine_headers)
        self.stopped = threading.Event()
        self.verdict: str | None = None
        self.serving = False

    def run(self) -> None:
        tokens: float | None = None
        failed: list[str] = []
        first_failure = 0.0
        while not self.stopped.wait(self.interval):
            try:
                # Unarmed (no request served yet): /health only, so the first request an engine sees is a
                # client's (the unpatched proof relies on that) and an engine nobody uses is not probed.
                probe_s = self.probe_s if self.serving else 0
                _, tokens = health.progress_check(self.kind, self.port, self.timeout, probe_s, tokens, self.headers)
            except (health.Unhealthy, health.NotServed, ValueError, KeyError, IndexError) as exc:
                if not self.serving:
                    continue
                if not failed:
                    first_failure = time.monotonic()
                failed.append(str(exc) or "not listening")
                if len(failed) >= self.failures:
                    self.verdict = (
                        f"no progress in {len(failed)} checks over "
                        f"{time.monotonic() - first_failure + self.probe_s:.0f}s: {failed[-1]}"
                    )
                    return
                continue
            if self.serving and self.probe_s:
                health.record_watchdog_pass(self.port)  # the image's healthcheck then need not probe too
            self.serving = self.serving or tokens > 0
            failed.clear()


def watchdogs(settings: Settings, engines: Iterable[health.Target]) -> dict[str, Watchdog]:
    """One :class:`Watchdog` per engine child, by its name. ``MMCPU_WATCHDOG_INTERVAL_S=0``: none."""
    if not settings.watchdog_interval_s:
        return {}
    return {
        t.name: Watchdog(
            t.kind,
            t.port,
            interval=settings.watchdog_interval_s,
            failures=settings.watchdog_failures,
            timeout=settings.health_timeout_s,
            probe_s=settings.health_probe_s,
            headers=health.engine_headers(settings),
        )
        for t in engines
    }


def supervise(
    children: list[Process],
    role: str = "engine",
    *,
    drain_s: float = 0,
    ports: Mapping[str, int] | None = None,
    watch: Mapping[str, Watchdog] | None = None,
) -> int:
    """Run the processes as children; stop all of them when one exits or on SIGTERM/SIGINT (container stop).

    An exit nobody asked for (no SIGTERM/SIGINT reached us) is a failure even when the child says 0: vLLM's API
    server exits 0 after its EngineCore died (EngineDeadError). Then one line on stderr says why and the
    return code is non-zero, so `docker compose logs` shows the reason and the restart policy brings it back.
    On a stop, a child still running after its drain time (``drain_s`` if it serves its port, else only
    STARTUP_GRACE_S: vLLM ignores SIGTERM while it starts) is killed with its descendants.

    A hung engine (``watch``: its :class:`Watchdog` gave up on it) is killed with its descendants at once (a
    stopped or deadlocked process does not drain), with one line saying why, and the others are stopped: exit 1.
    """
    procs = {c.name: subprocess.Popen(c.argv, env=c.env) for c in children}
    engines = {c.name for c in children if c.name != health.GATEWAY}
    watch = watch or {}
    for dog in watch.values():
        dog.start()
    stopping = False
    deadlines: dict[str, float] = {}

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for dog in watch.values():
            dog.stopped.set()
        for name, proc in procs.items():
            if proc.poll() is None and name not in deadlines:
                port = (ports or {}).get(name)
                serving = port is None or listening(port)
                deadlines[name] = time.monotonic() + (drain_s if serving else 0) + STARTUP_GRACE_S
                proc.send_signal(signal.SIGTERM)

    def requested(signum: int, frame: object) -> None:
        print(
            f"[mmcpu] {role}: {signal.Signals(signum).name}: stopping (in-flight requests may drain)",
            file=sys.stderr,
            flush=True,
        )
        stop(signum, frame)

    signal.signal(signal.SIGTERM, requested)
    signal.signal(signal.SIGINT, requested)
    rc = 0
    while procs:
        for name, dog in watch.items():
            if dog.verdict and not stopping and name in procs:
                label = name if name == "engine" else f"{name} engine"
                print(
                    f"[mmcpu] {role}: {label} hung ({dog.verdict}); killing it and exiting 1",
                    file=sys.stderr,
                    flush=True,
                )
                kill_tree(procs[name].pid)
                rc = 1
                stop(signal.SIGTERM, None)
        for name, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                if name in deadlines and time.monotonic() > deadlines[name]:
                    print(
                        f"[mmcpu] {role}: {name} still running after its drain time; killing it",
                        file=sys.stderr,
                        flush=True,
                    )
                    kill_tree(proc.pid)
                    deadlines[name] = float("inf")
                continue
            del procs[name]
            if stopping:
                # Asked to stop: pass a failure through, else a clean stop.
                rc = rc or exit_status(code)
                continue
            rc = exit_status(code) or 1
            why = "its EngineCore died?" if name in engines and code == 0 else "crashed?"
            print(
                f"[mmcpu] {role}: {name} exited with {exit_status(code)} without a stop request ({why}); exiting {rc}",
                file=sys.stderr,
                flush=True,
            )
            stop(signal.SIGTERM, None)
        time.sleep(0.5)
    return rc
