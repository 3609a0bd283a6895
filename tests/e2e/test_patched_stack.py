"""The patched image's compose stack: the smoke must pass, the faults heal by themselves, a mixed load has no
failures, both engines run MRV2. The tests run in this order on one stack (the module's ``patched_stack``); each
fault test first waits until every service is healthy again, so one that fails does not take the next with it.

Faults are made behind Docker's back, as a crash or a deadlock would be: `docker kill` counts as a stop and is
not restarted (docs/docker.md), so processes are signalled on the host (the containers share its kernel)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmcpu_dev.servers import MRV2_LOG_LINE
from mmcpu_dev.smoke import read_load

from .harness import (
    LOGS,
    OTHER,
    PROCESSES,
    SERVICES,
    Config,
    Figures,
    Stack,
    Tally,
    docker_time,
    say,
    stopped,
    wait_for,
    zombies,
)

pytestmark = pytest.mark.e2e
faults = pytest.mark.skipif(not Config.from_env().faults, reason="E2E_FAULTS=0")

QUICK_S = 3  # a route whose engine is down must answer 503 this fast through the gateway
HANG_WAITER_S = 170  # the client timeout of the requests waiting on a hung engine: the gateway must answer first
HANG_DETECT_S = 300  # the launcher's watchdog must have killed a hung engine by then (defaults: ~50-60 s)


@pytest.fixture
def stack(patched_stack: Stack, cfg: Config) -> Stack:
    patched_stack.wait_all_healthy(cfg.restart_s)
    return patched_stack


def smoke_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[smoke]")]


def test_smoke_passes(stack: Stack, figures: Figures):
    log_path = LOGS / "smoke-patched.log"
    t0 = time.monotonic()
    code = stack.smoke(log_path)
    lines = smoke_lines(log_path.read_text(errors="replace"))
    for line in lines:
        say(line)
    passed, failed = sum(" PASS " in line for line in lines), sum(" FAIL " in line for line in lines)
    figures.add("patched: smoke", f"exit {code} in {time.monotonic() - t0:.0f}s; {passed} PASS / {failed} FAIL")
    assert code == 0, "the patched stack's smoke failed:\n" + "\n".join(line for line in lines if " FAIL " in line)


@faults
def test_hung_engine_core_is_detected_and_recovers(stack: Stack, cfg: Config, figures: Figures):
    """SIGSTOP of audio's EngineCore (what a deadlocked core looks like: vLLM's API server still answers /health
    and /metrics, no request ever finishes). Requests waiting on it get 503 engine_unavailable from the gateway
    once they stalled MMCPU_STALL_S (not the client's timeout), new ones at once; vision keeps answering; the
    launcher's watchdog kills the engine and exits 1 with one line, and the restart policy brings it back."""
    svc, other = "audio", "vision"
    probe = stack.probe()
    restarts0 = stack.restart_count(svc)
    core = stack.engine_core(svc)
    assert probe(svc, 60).status == 200, f"{svc} did not answer before the hang"
    say(f"fault: SIGSTOP to {svc}'s EngineCore (host pid {core.pid})")
    t_stop, wall_stop = time.monotonic(), time.time()
    others, t_exit = Tally(), None
    with stopped(core), ThreadPoolExecutor(2) as pool:
        waiters = [pool.submit(probe, svc, HANG_WAITER_S) for _ in range(2)]
        while time.monotonic() - t_stop < HANG_DETECT_S:
            others.add(probe(other, 60))
            if t_exit is None and stack.restart_count(svc) > restarts0:
                t_exit = time.monotonic() - t_stop
            if t_exit is not None and all(w.done() for w in waiters):
                break
            time.sleep(2)
        waiting = [w.result(timeout=HANG_WAITER_S + 30) for w in waiters]
    say(
        f"fault {svc} hung: the waiting requests ended {', '.join(map(str, waiting))}; {other} answered "
        f"{others.ok} x 200, {len(others.bad)} x not"
    )
    assert others.ok >= 1 and not others.bad, f"{svc} hung: {other} stopped answering: {others.bad[:3]}"
    assert all(a.status == 503 and a.code == "engine_unavailable" for a in waiting), (
        f"{svc} hung: the gateway did not answer its waiting requests with 503 engine_unavailable: {waiting}"
    )
    assert t_exit is not None, f"{svc} hung: the launcher did not exit for a restart within {HANG_DETECT_S} s"
    # The exit as Docker recorded it (the poll above is as coarse as a vision request plus 2 s).
    exited = docker_time(stack.state(svc).get("FinishedAt", ""))
    if exited and exited > wall_stop:
        t_exit = exited - wall_stop
    # Recovery: the first 200 through the gateway, by itself (no command of ours); meanwhile quick 503s.
    back, failed = probe.until_ok(svc, t_stop, cfg.restart_s)
    quick = [a for a in failed if a.status == 503 and a.seconds < QUICK_S]
    assert quick, f"{svc} hung: its route did not answer 503 within {QUICK_S} s through the gateway: {failed[:3]}"
    hung = f"[mmcpu] {svc}: {svc} engine hung (no progress"
    hung_lines = [line for line in stack.container_log(svc).splitlines() if hung in line]
    assert len(hung_lines) == 1, f"{svc} hung: expected one launcher line about the hang, found {hung_lines}"
    say(f"fault {svc}: {hung_lines[0]}")
    figures.add(
        f"fault: {svc} EngineCore SIGSTOP -> gateway 503s",
        f"{max(a.seconds for a in waiting):.0f}s (waiting requests; new ones < {QUICK_S} s)",
    )
    figures.add(f"fault: {svc} EngineCore SIGSTOP -> launcher exits", f"{t_exit:.0f}s")
    figures.add(f"fault: {svc} EngineCore SIGSTOP -> serving again", f"{back:.0f}s")


@faults
@pytest.mark.parametrize(("svc", "what"), [("audio", "engine-core"), ("vision", "container")])
def test_killed_engine_comes_back_by_itself(stack: Stack, cfg: Config, figures: Figures, svc: str, what: str):
    """SIGKILL to an engine's EngineCore (the API server then exits, the launcher maps that to a non-zero exit)
    or to its container's PID 1: its route answers 503 quickly, the other modality keeps answering, and it comes
    back by itself (Docker's restart policy)."""
    other = OTHER[svc]
    probe = stack.probe()
    restarts0 = stack.restart_count(svc)
    pid = stack.engine_core(svc).pid if what == "engine-core" else stack.state(svc)["Pid"]
    say(f"fault: SIGKILL to {svc}'s {what} (host pid {pid})")
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    time.sleep(3)
    down, others = [], Tally()
    for _ in range(8):  # while it is down: up to 8 probes of each modality, 2 s apart
        answer = probe(svc, 10)
        if answer.status == 200:
            break  # back already
        down.append(answer)
        others.add(probe(other, 60))
        time.sleep(2)
    quick = [a for a in down if a.status == 503 and a.seconds < QUICK_S]
    say(
        f"fault {svc}: while down, {len(quick)} quick 503s (< {QUICK_S} s) of {len(down)}; {other} answered "
        f"{others.ok} x 200, {len(others.bad)} x not"
    )
    assert quick, f"{svc} down: its route did not answer 503 quickly through the gateway: {down[:3]}"
    assert others.ok >= 1 and not others.bad, f"{svc} down: {other} stopped answering: {others.bad[:3]}"
    back, _ = probe.until_ok(svc, t_kill, cfg.restart_s)
    restarts = stack.restart_count(svc)
    assert restarts > restarts0, f"{svc} answered again, but Docker did not restart it (RestartCount {restarts})"
    figures.add(f"fault: {svc} {what} killed -> serving again", f"{back:.0f}s (restarts {restarts0} -> {restarts})")
    if what == "engine-core":
        assert f"[mmcpu] {svc}: {svc} exited with 0 without a stop request" in stack.container_log(svc), (
            f"{svc}: no launcher line about the unrequested exit in its log"
        )


@faults
def test_gateway_restart_loses_no_request_outside_its_window(stack: Stack, figures: Figures):
    """`compose restart gateway` under a 4-way load: only requests started inside the restart window (restart ->
    /ping answers) may fail, and requests succeed after it."""
    log_path, stop_file = LOGS / "fault-gateway-load.log", "/tmp/mmcpu-e2e-load-stop"
    # The load runs until this test has seen what it needs, then is told to stop (a file in its container): the
    # window's length depends on the machine (the gateway drains its requests in flight), so no fixed duration
    # fits every one. --duration-s only caps it should the stop never arrive.
    with stack.smoke_background(
        log_path, "--load", "100000", "--duration-s", "600", "--concurrency", "4", "--stop-file", stop_file
    ) as load:
        wait_for("the load getting going", lambda: len(read_load(load.output())[0]) >= 6 or not load.running(), 300)
        assert load.running(), f"the load ended before the restart: {load.output()[-1000:]}"
        # `compose restart` does not use stop_grace_period (10 s, docker/compose#10670): give the gateway the
        # grace of a stop, so it drains its requests in flight instead of being killed after 10 s.
        t_a = time.time()
        say("fault: docker compose restart gateway (mid-load)")
        stack.compose("restart", "-t", str(stack.cfg.stop_grace_s), "gateway", timeout=stack.cfg.stop_grace_s + 300)
        wait_for("the gateway answering /ping after its restart", stack.pings, 300, every_s=0.2)
        t_b = time.time()
        # Requests from after the window, then stop; the ones in flight complete and are checked too.
        after_window = lambda: [r for r in read_load(load.output())[0] if r["ok"] and r["t0"] > t_b + 0.5]  # noqa: E731
        try:
            wait_for("a request after the window succeeding", lambda: after_window() or not load.running(), 300)
        except TimeoutError:
            pass  # judged below
        smoke_ids = stack.containers("smoke", running=True)
        if not smoke_ids or stack.docker("exec", smoke_ids[0], "touch", stop_file, check=False).returncode != 0:
            say("gateway fault: could not signal the load to stop; it ends at its --duration-s")
        load.wait(timeout=900)
    records, _ = read_load(load.output())
    inside = [r for r in records if t_a <= r["t0"] <= t_b + 0.5]
    lost = [r for r in records if not r["ok"] and r not in inside]
    after = [r for r in records if r["t0"] > t_b + 0.5 and r["ok"]]
    spanning = [r for r in records if r["t0"] < t_a < r["t1"] and r["ok"]]
    say(
        f"gateway restart window {t_b - t_a:.1f}s: {len(records)} requests, {sum(not r['ok'] for r in inside)} of "
        f"{len(inside)} started inside it failed, {len(lost)} outside; {len(spanning)} in flight at the restart "
        f"completed; {len(after)} ok after it"
    )
    figures.add("fault: gateway restart window (restart -> /ping)", f"{t_b - t_a:.1f}s")
    assert not lost, f"the gateway restart lost requests outside its window: {lost[:5]} (log {log_path})"
    assert after, f"no request succeeded after the gateway restart (log {log_path})"


@faults
def test_compose_stop_drains_a_long_transcription(stack: Stack, cfg: Config, figures: Figures):
    """`compose stop audio` during a long transcription: the engine drains it (--shutdown-timeout) and exits 0;
    `compose start audio` brings it back healthy."""
    log_path = LOGS / "fault-stop-long.log"
    with stack.smoke_background(log_path, "--long-s", f"{cfg.long_s:g}") as client:
        wait_for("the long transcription being sent", lambda: "[long] sending" in client.output(), 300)

        # Stop only once the engine really runs it (vLLM's gauge), else this would pass with nothing in flight.
        def in_flight() -> bool:
            assert "[long] PASS" not in client.output() and "[long] FAIL" not in client.output(), (
                "the transcription ended before the stop (make E2E_LONG_S longer)"
            )
            return stack.running_requests("audio") > 0

        wait_for("the long transcription running on the audio engine", in_flight, 120, every_s=0.5)
        sending = next(line for line in client.output().splitlines() if line.startswith("[long] sending"))
        say(f"fault: docker compose stop audio during the transcription ({sending})")
        t0 = time.monotonic()
        stack.compose("stop", "audio", timeout=cfg.stop_grace_s + 300)
        stop_s = time.monotonic() - t0
        client.wait(timeout=300)
    try:
        long_lines = [line for line in client.output().splitlines() if line.startswith("[long]")]
        for line in long_lines:
            say(line)
        state = stack.state("audio")
        assert any(line.startswith("[long] PASS") for line in long_lines), (
            f"the transcription in flight did not complete across the stop: {long_lines}"
        )
        assert "EngineCore: draining in-flight requests" in stack.container_log("audio"), (
            "audio's vLLM did not log a drain on SIGTERM"
        )
        assert state["ExitCode"] == 0, f"audio stopped with {state['ExitCode']} (137: killed after the grace period)"
        figures.add(
            "fault: compose stop audio with a long transcription in flight",
            f"stopped after {stop_s:.0f}s, request completed, exit 0",
        )
    finally:  # audio comes back whatever the result: the tests after this one need it
        stack.compose("start", "audio", timeout=300)
    figures.add("audio start -> healthy (restart, warm volume)", f"{stack.wait_healthy('audio', cfg.restart_s):.0f}s")


def test_mixed_load_has_no_failures(stack: Stack, cfg: Config, figures: Figures):
    """Audio and vision at concurrency 8, half of each with temperature 0.8 / top_p 0.9."""
    log_path = LOGS / "load-patched.log"
    code = stack.smoke(log_path, "--load", str(cfg.load_n), "--concurrency", "8")
    records, s = read_load(log_path.read_text(errors="replace"))
    failed = [r for r in records if not r["ok"]]
    if s:
        parts = [
            f"{k} {v['failures']}/{v['n']} failed p50 {v['p50_s']}s p95 {v['p95_s']}s"
            for k, v in s.items()
            if isinstance(v, dict)
        ]
        figures.add(
            "patched: mixed load",
            f"{s['requests']} requests, concurrency {s['concurrency']}, "
            f"{s['failures']} failures, p50 {s['p50_s']}s, p95 {s['p95_s']}s, "
            f"{s['wall_s']}s; " + ", ".join(parts),
        )
    assert s is not None, f"the load printed no summary (exit {code}; log {log_path})"
    assert code == 0 and not failed, f"the mixed load had failures: {failed[:5]} (log {log_path})"


# What a container's processes run with, as the kernel has it (printed as JSON by python -S -c in the container).
HARDENING = """
import json, os
status = dict(line.split(":\\t", 1) for line in open("/proc/1/status").read().splitlines() if ":\\t" in line)
def writable(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
        return True
    except OSError:
        return False
print(json.dumps({"pid1": status["Name"].strip(), "uid": status["Uid"].split()[0],
                  "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
                  "no_new_privs": status["NoNewPrivs"].strip(), "root_writable": writable("/etc/mmcpu-write-test"),
                  "home_writable": writable(os.path.expanduser("~/mmcpu-write-test")),
                  "tmp_writable": writable("/tmp/mmcpu-write-test")}))
"""
CONNECT = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        out[target] = "connected"
    except OSError as exc:
        out[target] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_services_run_hardened_under_tini_and_leave_no_zombie(stack: Stack, figures: Figures):
    """After the faults and the load: in every service, tini is PID 1, the process has no capability (effective
    or bounding) and no_new_privs, the root filesystem and the image's home are read-only, /tmp is writable, and
    no zombie stays (one seen twice 5 s apart is not being reaped)."""
    seen = {}
    for svc in SERVICES:
        result = stack.exec_python(svc, HARDENING)
        assert result.returncode == 0, f"{svc}: {result.stdout}{result.stderr}"
        seen[svc] = state = json.loads(result.stdout)
        assert state["pid1"] == "tini", f"{svc}: PID 1 is {state['pid1']!r}"
        assert state["uid"] == "10001" and int(state["cap_eff"], 16) == 0 and int(state["cap_bnd"], 16) == 0, state
        assert state["no_new_privs"] == "1", f"{svc}: no_new_privs is off"
        assert not state["root_writable"] and not state["home_writable"], f"{svc}: writable root filesystem: {state}"
        assert state["tmp_writable"], f"{svc}: /tmp is not writable"
    first = {svc: zombies(stack.exec_python(svc, PROCESSES).stdout) for svc in SERVICES}
    time.sleep(5)
    stale = {svc: first[svc] & zombies(stack.exec_python(svc, PROCESSES).stdout) for svc in SERVICES}
    assert not any(stale.values()), f"zombies not reaped: {stale}"
    say(f"hardening as running: {seen}")
    figures.add(
        "patched: every service as running",
        "tini PID 1, uid 10001, no capabilities, no_new_privs, read-only root, no zombie after the faults",
    )


def test_engines_are_reachable_only_from_the_gateway(stack: Stack, figures: Figures):
    """The engines' network (compose.yaml): a client container of the stack (the smoke's, on the default network)
    reaches the gateway but no engine, neither by name nor by address; the gateway reaches both; an engine reaches
    nothing off its network (here: the gateway's address on the default network)."""
    audio_ip, vision_ip = stack.ip("audio", "engines"), stack.ip("vision", "engines")
    gateway_ip = stack.ip("gateway", "default")
    client = stack.run_python(
        "smoke", CONNECT, "gateway:8000", "audio:8001", "vision:8002", f"{audio_ip}:8001", f"{vision_ip}:8002"
    )
    assert client.returncode == 0, client.stdout + client.stderr
    seen = json.loads(client.stdout.strip().splitlines()[-1])
    assert seen["gateway:8000"] == "connected", f"the client container does not reach the gateway: {seen}"
    reached = [t for t, r in seen.items() if t != "gateway:8000" and r == "connected"]
    assert not reached, f"a client container reaches engines directly: {reached}"
    gateway = json.loads(stack.exec_python("gateway", CONNECT, "audio:8001", "vision:8002").stdout)
    assert set(gateway.values()) == {"connected"}, f"the gateway does not reach the engines: {gateway}"
    out = json.loads(stack.exec_python("audio", CONNECT, f"{gateway_ip}:8000").stdout)
    assert out[f"{gateway_ip}:8000"] != "connected", f"an engine reaches off its network: {out}"
    say(f"network: client -> {seen}; audio -> {out}")
    figures.add(
        "patched: engines' network",
        "a client reaches the gateway only; an engine nothing off its network "
        f"({out[f'{gateway_ip}:8000'].split(':')[0]})",
    )


def test_each_service_holds_only_its_own_keys(stack: Stack, cfg: Config):
    """The keys as the containers have them: the client key in the gateway only, the internal key in the engines and
    the gateway; and the gateway refuses a request without the client key."""
    for svc in SERVICES:
        # Entries without "=" are names compose passes unset (a setting not in the caller's shell).
        env = dict(e.split("=", 1) for e in stack.docker.inspect(stack.container(svc))["Config"]["Env"] if "=" in e)
        holders = {name for name, value in env.items() if cfg.api_key in value}
        assert holders == ({"MMCPU_API_KEY"} if svc == "gateway" else set()), f"{svc}: client key in {holders}"
        holders = {name for name, value in env.items() if cfg.engine_api_key in value}
        assert holders == {"MMCPU_ENGINE_API_KEY"}, f"{svc}: internal key in {holders}"
    assert httpx.get(f"{stack.gateway}/v1/models", timeout=10).status_code == 401
    ok = httpx.get(f"{stack.gateway}/v1/models", timeout=10, headers={"Authorization": f"Bearer {cfg.api_key}"})
    assert ok.status_code == 200, ok.text[:300]


ENGINE_MODELS = """
import os, sys, urllib.error, urllib.request
def status(headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
print(status({}), status({"Authorization": "Bearer " + os.environ["MMCPU_ENGINE_API_KEY"]}))
"""


def test_engines_refuse_requests_without_the_internal_key(stack: Stack):
    for svc, port in (("audio", 8001), ("vision", 8002)):
        result = stack.exec_python("gateway", ENGINE_MODELS, f"http://{svc}:{port}/v1/models")
        assert result.stdout.split() == ["401", "200"], f"{svc}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize("svc", ["audio", "vision"])
def test_engines_run_model_runner_v2(patched_stack: Stack, svc: str):
    assert MRV2_LOG_LINE in patched_stack.service_log(svc), f"{svc} engine log lacks {MRV2_LOG_LINE!r}"
