"""mmcpu.launch's supervision, with real child processes and real signals.

The container's exit code is what Docker's restart policy acts on: an engine whose vLLM exits 0 without being
asked to (vLLM's API server does after EngineDeadError) must make the launcher exit non-zero; a requested stop
must exit 0 after the child drained; a child that ignores SIGTERM must not outlive its drain time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mmcpu import health, launch
from mmcpu.config import Settings
from mmcpu.cpu import Cpus
from mmcpu.proc import exit_status


def supervisor(child: str, *, drain_s: float = 0, grace_s: float = 15) -> subprocess.Popen:
    """A launcher (in its own process, so it can take signals) supervising one python child running `child`."""
    code = textwrap.dedent(f"""
        import sys
        from mmcpu import supervisor
        supervisor.STARTUP_GRACE_S = {grace_s}
        child = supervisor.Process("audio", [sys.executable, "-c", {child!r}], None)
        sys.exit(supervisor.supervise([child], "audio", drain_s={drain_s}))
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
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), print('drained', flush=True), sys.exit(0)))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(60)"
    )
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
    child = (
        f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); "
        "time.sleep(120)"
    )
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
    assert exit_status(-signal.SIGKILL) == 137
    assert exit_status(3) == 3


def test_entrypoint_writes_the_role_for_the_healthcheck(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "run", lambda children, role, settings, specs: seen.update(role=role) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    assert launch.entrypoint(["vision"]) == 0
    assert seen["role"] == "vision"
    assert (tmp_path / "role").read_text() == "vision"


# --- CPU placement: threads from the CPUs given -----------------------------------------------------------------


@pytest.mark.parametrize(
    "cpus, expected",
    [
        (Cpus((0, 1)), {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}),  # compose, 2-CPU host
        (Cpus((0, 1), 2.0), {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}),  # cpus: 2 on 2 CPUs
        (Cpus((4, 5, 6), 3.0), {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6", "OMP_NUM_THREADS": "3"}),  # a cpuset of its own
        (
            Cpus(tuple(range(64)), 2.0),
            {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"},
        ),  # k8s, shared node
        (
            Cpus(tuple(range(64)), 2.5),
            {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"},
        ),  # quota rounds down
        (Cpus(tuple(range(64)), 0.5), {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}),  # at least one
        (Cpus(tuple(range(8))), {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6", "OMP_NUM_THREADS": "7"}),  # 1 reserved
        (Cpus(tuple(range(16))), {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, range(14))), "OMP_NUM_THREADS": "14"}),
    ],
)
def test_threads_follow_the_cpus_given(cpus, expected):
    assert launch.placement(Settings(), cpus) == expected


def test_reserved_cpus_and_explicit_binds():
    assert launch.placement(Settings(reserved_cpus=1), Cpus((0, 1, 2, 3)))["OMP_NUM_THREADS"] == "3"
    assert launch.placement(Settings(reserved_cpus=9), Cpus((0, 1)))["OMP_NUM_THREADS"] == "1"
    for value in ("auto", "nobind", "0-3"):  # anything but "cpus" goes to vLLM as it is, threads untouched
        assert launch.placement(Settings(omp_threads_bind=value), Cpus((0, 1))) == {"VLLM_CPU_OMP_THREADS_BIND": value}


def test_all_role_splits_from_four_cpus_and_shares_below():
    def binds(cpus):
        return [
            env["VLLM_CPU_OMP_THREADS_BIND"]
            for name, _, env in launch.role_commands("all", Settings(), cpus=cpus)
            if name != "gateway"
        ]

    assert binds(Cpus((0, 1))) == ["0,1", "0,1"]  # one core each would leave one idle whenever one engine is
    assert binds(Cpus((0, 1, 2, 3))) == ["0,1", "2,3"]
    assert binds(Cpus(tuple(range(64)), 8.0)) == ["nobind", "nobind"]
    threads = [
        env["OMP_NUM_THREADS"]
        for n, _, env in launch.role_commands("all", Settings(), cpus=Cpus(tuple(range(64)), 8.0))
        if n != "gateway"
    ]
    assert threads == ["4", "4"]  # a quota over a shared node: halved as well
    # The single-engine roles keep every CPU.
    [(_, _, env)] = launch.role_commands("audio", Settings(), cpus=Cpus((0, 1, 2, 3)))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"


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


@pytest.mark.parametrize(
    "settings, needle",
    [
        (Settings(runner="v1"), "MMCPU_RUNNER=v1 needs a C++ compiler"),
        (Settings(compile=True), "MMCPU_COMPILE=1 needs a C++ compiler"),
    ],
)
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


# --- an engine spec makes vLLM's command line and environment ----------------------------------------------------
def option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times: {argv}"
    return argv[argv.index(name) + 1]


def test_engine_spec_makes_argv_and_env(tmp_path):
    from mmcpu import defaults

    model = tmp_path / "my-whisper"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "whisper"}')
    spec = launch.EngineSpec("ocr", str(model), 8011, ("--max-num-seqs", "3"), Cpus((2, 3)))
    assert spec.kind == "audio" and spec.target == health.Target("ocr", 8011, "audio")  # derived once, from the model
    settings = Settings(drain_s=30, kernel_stats=None)
    chosen = defaults.Resolved(model=str(model) + "-int8", dtype="bfloat16", quantization="int8", why="test")
    argv, env = spec.argv(settings, chosen), spec.env(settings, base={"KEEP": "1"})
    assert option(argv, "--model") == str(model) + "-int8"
    assert option(argv, "--served-model-name") == "my-whisper"  # the name clients know, whatever is loaded
    assert (option(argv, "--port"), option(argv, "--dtype"), option(argv, "--shutdown-timeout")) == (
        "8011",
        "bfloat16",
        "30",
    )
    assert argv[-2:] == ["--max-num-seqs", "3"]
    assert env["KEEP"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and env["OMP_NUM_THREADS"] == "2"
    assert env["MMCPU_KERNEL_STATS"] == str(health.kernel_stats_path(settings, 8011))
    # An explicit kind and served name win over the model's.
    named = launch.EngineSpec("x", str(model), 1, kind="vision", served_model_name="public")
    assert named.kind == "vision" and option(named.argv(settings, chosen), "--served-model-name") == "public"


def test_vllm_gets_its_shutdown_timeout_once():
    for child in launch.role_commands("all", Settings(extra_args="--max-num-seqs 4"), cpus=Cpus((0, 1))):
        if child.name != "gateway":
            assert option(child.argv, "--shutdown-timeout") == "120"


def test_gateway_runs_as_its_module():
    gateway = launch.role_commands("gateway", Settings(), base={"A": "b"})
    assert [(p.name, p.argv[1:], p.env) for p in gateway] == [("gateway", ["-m", "mmcpu.gateway"], {"A": "b"})]


EXTRA = (
    '{"ocr": {"model": "/models/tiny-qwen2-vl", "port": 8003, "args": "--max-num-seqs 2"}, '
    '"asr": {"model": "/models/speech", "port": 8004, "kind": "audio"}}'
)


def test_settings_describe_any_number_of_engines(monkeypatch):
    monkeypatch.setenv("MMCPU_ENGINE_ROLES", EXTRA)
    settings = Settings()
    assert list(settings.roles) == ["audio", "vision", "ocr", "asr"]  # audio and vision stay the defaults
    assert health.roles(settings) == ("audio", "vision", "ocr", "asr", "gateway", "all")
    assert [(t.name, t.port, t.kind) for t in health.role_targets(settings)] == [
        ("audio", 8001, "audio"),
        ("vision", 8002, "vision"),
        ("ocr", 8003, "vision"),
        ("asr", 8004, "audio"),
    ]
    [ocr] = launch.role_commands("ocr", settings, cpus=Cpus((0, 1)))
    assert ocr.name == "ocr" and option(ocr.argv, "--port") == "8003" and ocr.argv[-2:] == ["--max-num-seqs", "2"]
    # `all` runs every engine and the gateway; from 2 CPUs per engine each gets cores of its own.
    everything = launch.role_commands("all", settings, cpus=Cpus(tuple(range(8))))
    assert [p.name for p in everything] == ["audio", "vision", "ocr", "asr", "gateway"]
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in everything[:4]] == ["0,1", "2,3", "4,5", "6,7"]
    # Today's names still describe audio and vision.
    monkeypatch.setenv("MMCPU_VISION_PORT", "9002")
    assert Settings().roles["vision"].port == 9002


@pytest.mark.parametrize(
    "roles, needle",
    [
        ('{"all": {"model": "m", "port": 1}}', "other than gateway / all"),
        ('{"audio": {"model": "m", "port": 1}}', "MMCPU_AUDIO_MODEL"),
        ('{"Bad Name": {"model": "m", "port": 1}}', "lower-case name"),
        ('{"ocr": {"model": "m"}}', "port"),
        ('{"ocr": {"model": "m", "port": 1, "kind": "video"}}', "kind"),
    ],
)
def test_engine_roles_that_cannot_work_are_refused(monkeypatch, roles, needle):
    from pydantic import ValidationError

    monkeypatch.setenv("MMCPU_ENGINE_ROLES", roles)
    with pytest.raises(ValidationError, match=needle):
        Settings()


def test_entrypoint_runs_a_role_of_the_settings(monkeypatch, tmp_path):
    from mmcpu.config import get_settings

    seen = {}
    monkeypatch.setattr(
        launch,
        "run",
        lambda children, role, settings, specs: (
            seen.update(role=role, children=[c.name for c in children], targets=[s.target for s in specs]) or 0
        ),
    )
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    monkeypatch.setattr(launch, "preflight", lambda settings, **_: None)
    monkeypatch.setenv("MMCPU_ENGINE_ROLES", EXTRA)
    get_settings.cache_clear()
    try:
        assert launch.entrypoint(["asr"]) == 0
        assert seen == {"role": "asr", "children": ["asr"], "targets": [health.Target("asr", 8004, "audio")]}
        assert (tmp_path / "role").read_text() == "asr"
        with pytest.raises(SystemExit):
            launch.entrypoint(["nobody"])  # argparse: not a role of these settings
    finally:
        get_settings.cache_clear()


def test_media_settings_reach_every_engine():
    """mmcpu's media connector for every engine (set, not defaulted: an inherited VLLM_MEDIA_CONNECTOR cannot reopen
    fetching); MMCPU_MAX_IMAGES as a vision engine's --limit-mm-per-prompt unless its args carry their own;
    MMCPU_MEDIA_DOMAINS as --allowed-media-domains."""
    settings = Settings(max_images=2, media_domains="img.example.com, cdn.example.org", max_image_pixels=1000)
    env = launch.engine_env(settings, base={"VLLM_MEDIA_CONNECTOR": "http"}, cpus=Cpus((0,)))
    assert env["VLLM_MEDIA_CONNECTOR"] == "mmcpu" and env["VLLM_MAX_IMAGE_PIXELS"] == "1000"
    vision = launch.engine_argv("/models/tiny-llava", settings, port=8002, kind="vision")
    at = vision.index("--limit-mm-per-prompt")
    assert json.loads(vision[at + 1]) == {"image": 2} and vision.count("--limit-mm-per-prompt") == 1
    assert vision[vision.index("--allowed-media-domains") + 1 :][:2] == ["img.example.com", "cdn.example.org"]
    own = launch.engine_argv(
        "/models/tiny-llava", settings, port=8002, kind="vision", extra=["--limit-mm-per-prompt", '{"image":1}']
    )
    assert own.count("--limit-mm-per-prompt") == 1 and own[-1] == '{"image":1}'
    audio = launch.engine_argv("/models/whisper-tiny.en", Settings(), port=8001, kind="audio")
    assert "--limit-mm-per-prompt" not in audio and "--allowed-media-domains" not in audio


def test_an_engine_without_the_plugin_is_refused(monkeypatch):
    """Without the plugin VLLM_MEDIA_CONNECTOR=mmcpu names nothing, whatever the runner."""
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    reason = launch.preflight(Settings(runner="v2", triton_interpret=False), env={"CXX": "/bin/true"})
    assert reason and "media connector" in reason


def test_engine_key_reaches_vllm_in_its_environment_only():
    """MMCPU_ENGINE_API_KEY becomes vLLM's VLLM_API_KEY (its environment), never --api-key on the command line; without
    the setting an inherited VLLM_API_KEY is dropped, since the gateway and the health checks would not send it.
    The real engine's 401 and the senders: tests/test_gateway_engine_key.py."""
    settings = Settings(engine_api_key="internal-secret")
    env = launch.engine_env(settings, base={}, cpus=Cpus((0,)))
    assert env["VLLM_API_KEY"] == "internal-secret"
    for kind, model in (("audio", "/models/whisper-tiny.en"), ("vision", "/models/tiny-llava")):
        argv = launch.engine_argv(model, settings, port=8001, kind=kind)
        assert "--api-key" not in argv and not any("internal-secret" in a for a in argv)
    assert "VLLM_API_KEY" not in launch.engine_env(Settings(), base={"VLLM_API_KEY": "stale"}, cpus=Cpus((0,)))
    assert health.engine_headers(settings) == {"Authorization": "Bearer internal-secret"}
    assert health.engine_headers(Settings()) == health.engine_headers(Settings(engine_api_key="")) == {}
