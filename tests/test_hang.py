"""A hung engine heals by itself: the launcher's watchdog, the healthcheck's progress test and the gateway's stall
detection, against a fake engine that stops answering (as a SIGSTOPped or deadlocked EngineCore does: vLLM's API
server still answers /health and /metrics, but no request ever finishes).

The real engine is in test_hang_real_engine_* (slow): SIGSTOP of a real EngineCore under the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest

from mmcpu import health, supervisor
from mmcpu.config import Settings

# The fake engine, also run as a launcher's child: `python -c FAKE PORT HANG_FILE` hangs while HANG_FILE exists.
FAKE = textwrap.dedent("""
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class State:
        tokens = 0
        hung = None        # callable: True while every POST must hang
        slow_s = 0.0       # a busy engine: each POST takes this long, counters moving every 0.1 s
        stop = threading.Event()
        posts = 0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def reply(self, status, body=b"", ctype="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if State.stop.is_set():  # closed: like a killed process, no keep-alive answers on
                self.close_connection = True
                return
            if self.path == "/health":
                self.reply(200)
            elif self.path == "/metrics":
                self.reply(200, f"vllm:prompt_tokens_total{{model_name=\\"m\\"}} {State.tokens}.0\\n".encode(),
                           "text/plain")
            elif self.path == "/v1/models":
                self.reply(200, json.dumps({"data": [{"id": State.model}]}).encode())
            else:
                self.reply(404)

        def do_POST(self):
            if State.stop.is_set():  # closed: like a killed process, no keep-alive answers on
                self.close_connection = True
                return
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            State.posts += 1
            if State.hung():
                State.stop.wait(300)  # never, for the test's purposes
                return
            end = time.monotonic() + State.slow_s
            while time.monotonic() < end:
                time.sleep(0.1)
                State.tokens += 1
            State.tokens += 1
            self.reply(200, json.dumps({"text": "", "choices": [{"message": {"content": "ok"}}]}).encode())

        def log_message(self, *args):
            pass

    def serve(port, model="fake-model"):
        State.model = model
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    if __name__ == "__main__":
        hang_file = sys.argv[2]
        State.hung = lambda: os.path.exists(hang_file)
        serve(int(sys.argv[1]))
        threading.Event().wait()
""")
fake = {"__name__": "fake_engine"}
exec(compile(FAKE, "fake_engine", "exec"), fake)
State = fake["State"]


class FakeEngine:
    def __init__(self, model: str = "fake-model", *, port: int = 0) -> None:
        self.hung = threading.Event()
        self.slow_s = 0.0
        self.state = type("S", (State,), {"tokens": 0, "posts": 0, "stop": threading.Event()})
        self.state.hung = self.hung.is_set
        handler = type("H", (fake["Handler"],), {})
        # The handler reads State from its module: give this instance its own.
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _bind(handler, self.state))
        self.server.daemon_threads = True
        self.state.model = model
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.state.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _bind(handler: type, state: type) -> type:
    """The fake's handler, reading ``state`` instead of the module's State."""
    src = {"State": state, **{k: v for k, v in fake.items() if k != "State"}}
    return type(
        handler.__name__,
        (handler,),
        {"do_GET": _rebind(fake["Handler"].do_GET, src), "do_POST": _rebind(fake["Handler"].do_POST, src)},
    )


def _rebind(fn, globals_: dict):
    import types

    return types.FunctionType(fn.__code__, globals_, fn.__name__)


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        engine.close()


# --- healthcheck ----------------------------------------------------------------------------------------------
def test_progress_check_tells_hung_from_busy(engines) -> None:
    engine = FakeEngine()
    engines.append(engine)
    verdict, tokens = health.progress_check("vision", engine.port, 5, 1.0, None)
    assert verdict.startswith("ok (1-token probe") and tokens == 1
    engine.state.tokens += 5  # busy: counters moved, no probe sent
    posts = engine.state.posts
    assert health.progress_check("vision", engine.port, 5, 1.0, tokens)[0] == "ok (progress)"
    assert engine.state.posts == posts
    engine.hung.set()  # /health and /metrics still answer
    t0 = time.monotonic()
    with pytest.raises(health.Unhealthy, match=r"no progress: .*1-token probe, bound 1s"):
        health.progress_check("vision", engine.port, 5, 1.0, tokens + 5)
    assert time.monotonic() - t0 < 5


def test_healthcheck_trusts_a_fresh_watchdog_pass(engines, tmp_path, monkeypatch) -> None:
    engine = FakeEngine()
    engines.append(engine)
    monkeypatch.setattr(health, "STATE_DIR", tmp_path)
    engine.hung.set()
    health.record_watchdog_pass(engine.port)
    assert health.probe_engine("vision", engine.port, 5, 0.5, fresh_s=30).startswith("ok (launcher watchdog")
    assert engine.state.posts == 0
    health.watchdog_file(engine.port).write_text(json.dumps({"time": time.time() - 60}))
    with pytest.raises(health.Unhealthy):  # stale: it checks by itself
        health.probe_engine("vision", engine.port, 5, 0.5, fresh_s=30)


# --- launcher ---------------------------------------------------------------------------------------------------
def supervised_fake(tmp_path: Path, port: int, **settings: object) -> subprocess.Popen:
    """A launcher (own process) supervising the fake engine as its `audio` child, with a watchdog."""
    code = textwrap.dedent(f"""
        import sys
        from mmcpu import health, supervisor
        from mmcpu.config import Settings
        settings = Settings(**{settings!r})
        child = [sys.executable, "-c", {FAKE!r}, "{port}", "{tmp_path / "hang"}"]
        dogs = supervisor.watchdogs(settings, [health.Target("audio", {port}, "vision")])
        sys.exit(supervisor.supervise([supervisor.Process("audio", child, None)], "audio", ports={{"audio": {port}}},
                                      watch=dogs))
    """)
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    from mmcpu_dev.servers import free_port as free

    return free()


def test_watchdog_kills_a_hung_engine_and_exits_1(tmp_path: Path) -> None:
    port = free_port()
    proc = supervised_fake(tmp_path, port, watchdog_interval_s=0.3, watchdog_failures=2, health_probe_s=1.0)
    try:
        deadline = time.monotonic() + 60
        while True:  # a client's request arms the watchdog (before one, it only asks /health)
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "fake engine never served"
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        while int(float(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text.split()[-1])) < 2:
            assert time.monotonic() < deadline, "the watchdog never probed the armed engine"
            time.sleep(0.1)  # its own 1-token probe moved the counters: it is armed and passing
        child = psutil.Process(proc.pid).children()[0]
        (tmp_path / "hang").touch()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        detected_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if "hung" in line]
    assert len(lines) == 1, err
    assert "[mmcpu] audio: audio engine hung (no progress in 2 checks" in lines[0]
    assert "killing it and exiting 1" in lines[0]
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE
    # two failed probes of 1 s with 0.3 s between them, plus interpreter slack on a busy machine
    assert detected_s < 20, detected_s
    print(f"\n[fake hang detected and killed in {detected_s:.1f} s]")


def test_watchdog_leaves_a_slow_busy_engine_alone(engines) -> None:
    engine = FakeEngine()
    engines.append(engine)
    dog = supervisor.Watchdog("vision", engine.port, interval=0.2, failures=2, timeout=5, probe_s=0.5)
    dog.start()
    try:
        time.sleep(1)
        assert not dog.serving and engine.state.posts == 0  # no request yet: not armed, nothing sent
        httpx.post(f"{engine.url}/v1/completions", json={}, timeout=5)
        time.sleep(1)  # served and checked
        assert dog.serving
        engine.state.slow_s = 3.0  # each request now takes 3 s (6x the probe's bound) but counters move
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                httpx.post(f"{engine.url}/v1/completions", json={}, timeout=30)

        workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        time.sleep(4)
        assert dog.verdict is None and dog.is_alive()
        stop.set()
    finally:
        dog.stopped.set()
        engine.state.slow_s = 0


def test_watchdog_ignores_an_engine_still_starting(tmp_path: Path) -> None:
    port = free_port()
    dog = supervisor.Watchdog("vision", port, interval=0.1, failures=1, timeout=1, probe_s=0.5)
    dog.start()
    time.sleep(1)  # refused connections for 10 checks: not serving yet, no verdict
    dog.stopped.set()
    assert dog.verdict is None


def test_watchdogs_follow_the_settings() -> None:
    settings = Settings(watchdog_interval_s=0)
    target = health.Target("audio", 8001, "audio")
    assert supervisor.watchdogs(settings, [target]) == {}
    dogs = supervisor.watchdogs(Settings(watchdog_failures=4, health_probe_s=7), [target])
    assert dogs["audio"].failures == 4 and dogs["audio"].probe_s == 7 and dogs["audio"].kind == "audio"


def test_model_kind(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    assert health.model_kind(str(tmp_path / "w")) == "audio"
    assert health.model_kind(str(tmp_path / "l")) == "vision"
    assert health.model_kind("openai/whisper-tiny.en") == "audio"


# --- gateway ----------------------------------------------------------------------------------------------------
def test_gateway_503s_a_hung_engine_and_keeps_serving_the_other(engines) -> None:
    from mmcpu.gateway.app import create_app
    from mmcpu_dev.servers import ServedApp

    audio, vision = FakeEngine("audio-model"), FakeEngine("vision-model")
    engines += [audio, vision]
    stall_s = 2.0
    settings = Settings(engines=f"audio={audio.url},vision={vision.url}", stall_s=stall_s)
    served = ServedApp(create_app(settings))
    chat = {"model": "audio-model", "messages": [{"role": "user", "content": "hi"}]}
    other = {"model": "vision-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        audio.hung.set()
        results: list[tuple[int, dict, float]] = []

        def waiting() -> None:
            t0 = time.monotonic()
            r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60)
            results.append((r.status_code, r.json(), time.monotonic() - t0))

        waiters = [threading.Thread(target=waiting) for _ in range(2)]
        for w in waiters:
            w.start()
        time.sleep(0.5)
        # the other engine keeps serving while audio's requests wait
        assert httpx.post(f"{served.url}/v1/chat/completions", json=other, timeout=30).status_code == 200
        for w in waiters:
            w.join(60)
        # waiting requests given up with a 503 once stalled for stall_s (not the client's 60 s)
        assert [(s, b["error"]["code"]) for s, b, _ in results] == [(503, "engine_unavailable")] * 2, results
        assert all(stall_s <= took < stall_s + 10 for _, _, took in results), results
        assert "hung" in results[0][1]["error"]["message"]
        # new requests: 503 at once, the hung engine is not tried
        t0 = time.monotonic()
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - t0 < 1.5
        health = httpx.get(f"{served.url}/health", timeout=30).json()
        assert health["status"] == "degraded" and health["down"] == ["audio"], health  # /health 200 does not undo it
        # "restarted": a new process on the same port (counters start again); the gateway notices by itself
        port = audio.port
        audio.close()
        time.sleep(2)  # the background re-probe sees it gone
        restarted = FakeEngine("audio-model", port=port)
        engines.append(restarted)
        upstream = served.app.state.upstreams.engines["audio"]
        deadline = time.monotonic() + 15
        while not upstream.up:
            assert time.monotonic() < deadline, upstream.error
            time.sleep(0.1)
        assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
    finally:
        served.stop()


def test_gateway_keeps_a_slow_busy_engine(engines) -> None:
    from mmcpu.gateway.app import create_app
    from mmcpu_dev.servers import ServedApp

    engine = FakeEngine("m")
    engines.append(engine)
    engine.state.slow_s = 4.0  # twice the stall bound per request, counters moving
    served = ServedApp(create_app(Settings(engines=f"audio={engine.url}", stall_s=2.0)))
    try:
        r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
        assert r.status_code == 200, r.text
        assert served.app.state.upstreams.engines["audio"].up
    finally:
        served.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stall_detector_tells_a_stall_from_slow_progress() -> None:
    """The gateway's rule without a gateway: requests wait and nothing progresses for stall_s = a stall; response
    bytes or moved counters are progress; idle time before the first request waits does not count."""
    clock = Clock()
    stall = health.StallDetector(10, clock)
    clock.now += 60  # idle: nothing waits, nothing stalls
    assert stall.stalled() is None and not stall.counters_due()
    with stall.waiting():
        clock.now += 9.5
        assert stall.stalled() is None
        stall.progressed()  # bytes of another response
        clock.now += 9.5
        assert stall.stalled() is None
        assert stall.counters_due()  # quiet for a fifth of the window: the counters are read
        stall.counters(50.0)  # moved (from unknown): progress
        assert not stall.counters_due()  # read just now
        clock.now += 2.5
        assert stall.counters_due()
        stall.counters(50.0)  # unchanged: no progress
        clock.now += 7.5
        assert stall.stalled() == 10
        stall.hang()
        assert stall.is_hung and stall.hung.is_set()
    assert stall.inflight == 0
    assert not stall.recovered(50.0) and not stall.recovered(None) and stall.recovered(51.0)
    stall.clear()
    assert not stall.is_hung and not stall.hung.is_set()


def test_stall_detector_counts_waiting_requests_and_can_be_off() -> None:
    clock = Clock()
    stall = health.StallDetector(10, clock)
    with stall.waiting():
        clock.now += 5
        with stall.waiting():  # a second request does not restart the first one's wait
            clock.now += 5
            assert stall.inflight == 2 and stall.stalled() == 10
        assert stall.inflight == 1
    with pytest.raises(RuntimeError), stall.waiting():
        raise RuntimeError("the send failed")
    assert stall.inflight == 0 and stall.stalled() is None
    stall.hang()
    assert stall.hung_tokens == -1.0  # hung before its counters were ever read: any value is a change
    stall.forget()
    assert not stall.is_hung
    off = health.StallDetector(0, clock)
    with off.waiting():
        clock.now += 1000
        assert off.stalled() is None and not off.counters_due()


# --- a real engine ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hang_real_engine_sigstop_detected_and_launcher_exits_1(
    tmp_path: Path, llava_model: Path, patched_vllm: Path
) -> None:
    """SIGSTOP of a real MRV2 EngineCore under ``mmcpu-serve``: the launcher's watchdog finds no progress within
    its bound, kills the engine's tree and exits 1 with one line saying why."""
    from mmcpu.config import VISION_LIMIT_ARGS
    from mmcpu.gateway.app import create_app
    from mmcpu_dev.servers import Engine, ServedApp

    interval, failures, probe_s = 2.0, 2, 5.0
    engine = Engine(
        llava_model,
        tmp_path / "engine.log",
        vllm_args=list(VISION_LIMIT_ARGS),
        env={
            "MMCPU_WATCHDOG_INTERVAL_S": str(interval),
            "MMCPU_WATCHDOG_FAILURES": str(failures),
            "MMCPU_HEALTH_PROBE_S": str(probe_s),
            "MMCPU_KVCACHE_GIB": "0.25",
        },
    )
    engine.start(timeout_s=600)
    try:
        launcher = engine.proc.pid
        core = next(
            p
            for p in launch_tree(launcher)
            if p.name().startswith("VLLM::EngineCore") or "VLLM::EngineCore" in " ".join(p.cmdline())
        )
        # The gateway in front: a request waiting on the hung engine gets 503 after stall_s, not the client's 60 s.
        stall_s = 3.0
        served = ServedApp(create_app(Settings(engines=f"vision={engine.base_url}", stall_s=stall_s)))
        chat = {
            "model": engine.name,
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
        time.sleep(interval * 2)  # the watchdog has seen it serve
        os.kill(core.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60)
        gateway_s = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        served.stop()
        bound = failures * (probe_s + interval) + 30  # the checks' own bound, plus a busy machine's slack
        rc = engine.proc.wait(timeout=bound + 60)
        detected_s = time.monotonic() - t0
    finally:
        for p in launch_tree(engine.proc.pid if engine.proc else None):
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        engine.stop()
    log = engine.log()
    lines = [line for line in log.splitlines() if "engine hung" in line]
    assert rc == 1, log[-3000:]
    assert len(lines) == 1 and "no progress in 2 checks" in lines[0] and "exiting 1" in lines[0], lines
    assert detected_s < bound, detected_s
    assert gateway_s < stall_s + 15, gateway_s
    print(
        f"\n[real EngineCore SIGSTOPped: gateway 503 after {gateway_s:.1f} s (stall {stall_s:g} s); launcher exited 1 "
        f"after {detected_s:.1f} s: {lines[0]}]"
    )


def launch_tree(pid: int | None) -> list[psutil.Process]:
    from mmcpu.proc import tree

    return tree(pid)
