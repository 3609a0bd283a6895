"""mmcpu.launch's supervision, with real child processes and real signals.

The container's exit code is what Docker's restart policy acts on: an engine whose vLLM exits 0 without being
asked to (vLLM's API server does after EngineDeadError) must make the launcher exit non-zero; a requested stop
must exit 0 after the child drained; a child that ignores SIGTERM must not outlive its drain time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (Linux: bit 15 of SigCgt in /proc/PID/status).
    A python process does not catch SIGTERM until it installs a handler; supervise() does, right after it started
    its children."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def wait_until_ready(proc: subprocess.Popen, child_ready: Path, timeout_s: float = 60) -> None:
    """Until both the supervisor and its child have set up their SIGTERM handling: the child says so with a file
    it creates right after (signal.signal), the supervisor in its signal mask. Polled, not slept: interpreter start
    and imports take 0.5-1.5 s on a fast idle machine and several times that on a slow busy one; the bound only
    ends a run whose processes never get there (one that exits early fails at once)."""
    deadline = time.monotonic() + timeout_s
    while not (child_ready.exists() and catches_sigterm(proc.pid)):
        if proc.poll() is not None:
            pytest.fail(f"the supervisor exited with {proc.returncode} before it was ready: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"supervisor/child not ready to take SIGTERM within {timeout_s} s"
        time.sleep(0.02)


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


def test_requested_stop_waits_for_the_child_and_exits_0(tmp_path):
    ready = tmp_path / "child-ready"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), print('drained', flush=True), sys.exit(0)))\n"
             f"open({str(ready)!r}, 'w').close()\n"
             "time.sleep(60)")
    proc = supervisor(child, drain_s=30)
    wait_until_ready(proc, ready)  # a SIGTERM before the handlers are in would kill instead of stopping
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM: stopping" in err
    assert 1.4 < time.monotonic() - t0 < 20


def test_child_ignoring_sigterm_is_killed_after_its_grace(tmp_path):
    ready = tmp_path / "child-ready"
    child = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); "
             "time.sleep(120)")
    proc = supervisor(child, drain_s=0, grace_s=2)
    wait_until_ready(proc, ready)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # Killed once its 2 s grace ran out (the deadline is set when the SIGTERM arrives, after t0), long before the
    # child would have ended by itself (120 s).
    assert 2 <= time.monotonic() - t0 < 15
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
    monkeypatch.setattr(launch, "run", lambda commands, role, settings, ports, *_: seen.update(role=role) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    assert launch.entrypoint(["vision"]) == 0
    assert seen["role"] == "vision"
    assert (tmp_path / "role").read_text() == "vision"


# --- CPU placement: threads from the CPUs given -----------------------------------------------------------------
Cpus = launch.Cpus


@pytest.mark.parametrize("cpus, expected", [
    (Cpus((0, 1)), {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}),          # compose, 2-CPU host
    (Cpus((0, 1), 2.0), {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}),     # cpus: 2 on 2 CPUs
    (Cpus((4, 5, 6), 3.0), {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6", "OMP_NUM_THREADS": "3"}),  # a cpuset of its own
    (Cpus(tuple(range(64)), 2.0), {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}),  # k8s, shared node
    (Cpus(tuple(range(64)), 2.5), {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}),  # quota rounds down
    (Cpus(tuple(range(64)), 0.5), {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}),  # at least one
    (Cpus(tuple(range(8))), {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6", "OMP_NUM_THREADS": "7"}),  # 1 reserved
    (Cpus(tuple(range(16))), {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, range(14))), "OMP_NUM_THREADS": "14"}),
])
def test_threads_follow_the_cpus_given(cpus, expected):
    assert launch.placement(Settings(), cpus) == expected


def test_reserved_cpus_and_explicit_binds():
    assert launch.placement(Settings(reserved_cpus=1), Cpus((0, 1, 2, 3)))["OMP_NUM_THREADS"] == "3"
    assert launch.placement(Settings(reserved_cpus=9), Cpus((0, 1)))["OMP_NUM_THREADS"] == "1"
    for value in ("auto", "nobind", "0-3"):  # anything but "cpus" goes to vLLM as it is, threads untouched
        assert launch.placement(Settings(omp_threads_bind=value), Cpus((0, 1))) == {"VLLM_CPU_OMP_THREADS_BIND": value}


def test_all_role_splits_from_four_cpus_and_shares_below():
    def binds(cpus):
        return [env["VLLM_CPU_OMP_THREADS_BIND"] for name, _, env in launch.role_commands("all", Settings(), cpus=cpus)
                if name != "gateway"]
    assert binds(Cpus((0, 1))) == ["0,1", "0,1"]  # one core each would leave one idle whenever one engine is
    assert binds(Cpus((0, 1, 2, 3))) == ["0,1", "2,3"]
    assert binds(Cpus(tuple(range(64)), 8.0)) == ["nobind", "nobind"]
    threads = [env["OMP_NUM_THREADS"] for n, _, env in launch.role_commands("all", Settings(), cpus=Cpus(
        tuple(range(64)), 8.0)) if n != "gateway"]
    assert threads == ["4", "4"]  # a quota over a shared node: halved as well
    # The single-engine roles keep every CPU.
    [(_, _, env)] = launch.role_commands("audio", Settings(), cpus=Cpus((0, 1, 2, 3)))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_cgroup_cpu_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert launch.cgroup_cpu_quota(tmp_path) == expected


def test_this_process_cpus_are_read():
    cpus = Cpus.current()
    assert set(cpus.allowed) == os.sched_getaffinity(0) and 1 <= cpus.count <= len(cpus.allowed)


def test_engine_gets_kv_cache_bytes_and_the_uniproc_executor():
    env = launch.engine_env(Settings(kvcache_gib=0.25), base={"VLLM_CPU_KVCACHE_SPACE": "4"}, cpus=Cpus((0, 1)))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    argv = launch.engine_argv("/models/m", Settings(kvcache_gib=0.25), port=8001)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    mp = launch.engine_env(Settings(executor="mp"), base={}, cpus=Cpus((0, 1)))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in mp


# --- settings the environment cannot honour are refused at start, in one line --------------------------------
NO_CXX = {"CXX": "/nonexistent/c++"}


@pytest.mark.parametrize("settings, needle", [
    (Settings(runner="v1"), "MMCPU_RUNNER=v1 needs a C++ compiler"),
    (Settings(compile=True), "MMCPU_COMPILE=1 needs a C++ compiler"),
])
def test_compiler_needing_settings_are_refused_without_one(settings, needle):
    reason = launch.preflight(settings, NO_CXX)
    assert reason and needle in reason and "\n" not in reason
    assert launch.preflight(settings, {"CXX": sys.executable}) is None  # any existing program stands in for one
    assert launch.preflight(Settings(), NO_CXX) is None  # the default (MRV2, eager) needs none


def test_serve_and_entrypoint_refuse_before_starting_anything(monkeypatch, capsys, tmp_path):
    from mmcpu.config import get_settings
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    monkeypatch.setenv("CXX", NO_CXX["CXX"])
    get_settings.cache_clear()
    try:
        assert launch.main(["--model", "/models/m", "--runner", "v1"]) == 2
        assert "refusing to start: MMCPU_RUNNER=v1 needs a C++ compiler" in capsys.readouterr().err
        monkeypatch.setenv("MMCPU_COMPILE", "1")
        get_settings.cache_clear()
        assert launch.entrypoint(["vision"]) == 2
        assert "vision: refusing to start: MMCPU_COMPILE=1 needs" in capsys.readouterr().err
        assert launch.entrypoint(["gateway"]) == 0  # the gateway compiles nothing
        assert len(started) == 1
    finally:
        get_settings.cache_clear()


def test_engines_compute_in_the_per_cpu_dtype_unless_told_otherwise():
    from mmcpu import defaults

    def dtype(argv):  # vLLM's argparse: the last occurrence wins
        return argv[len(argv) - 1 - argv[::-1].index("--dtype") + 1]
    _, row = defaults.row()
    [(_, audio, _)] = launch.role_commands("audio", Settings(), cpus=Cpus((0, 1)))
    [(_, vision, _)] = launch.role_commands("vision", Settings(), cpus=Cpus((0, 1)))
    assert (dtype(audio), dtype(vision)) == (row.audio.dtype, row.vision.dtype)
    [(_, real, _)] = launch.role_commands("audio", Settings(audio_args="--dtype bfloat16"), cpus=Cpus((0, 1)))
    assert dtype(real) == "bfloat16"
    # MMCPU_DTYPE is every engine's, the roles' defaults included.
    both = launch.role_commands("all", Settings(dtype="bfloat16"), cpus=Cpus((0, 1)))
    assert [dtype(argv) for name, argv, _ in both if name != "gateway"] == ["bfloat16", "bfloat16"]
