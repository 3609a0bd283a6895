"""Run a real vLLM engine (through ``mmcpu-serve``) as a child process: for tests and benchmark scripts.

The process and its children are in their own process group, so stopping it stops vLLM's engine-core
workers too; the log goes to a file the caller can read (e.g. to prove ``Using V2 Model Runner``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mmcpu.kernels import dispatch
from mmcpu.proc import stop_group, tree_rss
from mmcpu_dev.shell import free_port  # one definition, stdlib only: the host scripts use it too

MRV2_LOG_LINE = "Using V2 Model Runner"


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds; fails after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start


def wait_until_ok(url: str, proc: subprocess.Popen, timeout_s: float, what: str, log_path: Path) -> None:
    """Poll ``url`` until it answers 200; fail early, with the log's tail, if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:]) if log_path.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} (log: {log_path}):\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s (log: {log_path})")


# Every engine a process started, in order, with its ready time: tests/conftest.py prints them at the session's end,
# since the engine starts are most of `make test`'s time (docs/ci.md).
STARTS: list[tuple[str, float]] = []


@dataclass
class Engine:
    model: Path
    log_path: Path
    runner: str = "v2"
    port: int = field(default_factory=free_port)
    pythonpath: Path | None = None  # put a vLLM copy (e.g. the unpatched overlay) in front of site-packages
    python: Path | None = None  # another venv's interpreter (the proof line's); default: this one
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra settings for this engine, e.g. MMCPU_KERNELS
    served_model_name: str | None = None  # default: the model folder's name (mmcpu-serve's default too)
    proc: subprocess.Popen | None = None
    ready_s: float | None = None
    started_at: float | None = None  # wall clock (time.time()) of the spawn: vLLM's log stamps are wall clock

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.name

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def kernel_stats_path(self) -> Path:
        """The engine's MRV2 kernel launch counts (MMCPU_KERNEL_STATS), beside its log."""
        return self.log_path.with_name(self.log_path.stem + ".kernels.json")

    def kernel_counts(self, timeout_s: float = 60) -> KernelCounts:
        """Launch counts that include every launch made before this call: waits (bounded) for a snapshot the
        engine wrote after the call began. Requests whose responses came back before it are all in it."""
        since = time.time()
        deadline = time.monotonic() + timeout_s
        while True:
            snap = dispatch.read_snapshot(self.kernel_stats_path)
            if snap is not None and snap["time"] >= since:
                return KernelCounts(Counter(snap["native"]), Counter(snap["interpreted"]), snap["time"])
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"engine for {self.model} is not running (log: {self.log_path})")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no kernel launch counts newer than {timeout_s:.0f}s in {self.kernel_stats_path}"
                    f" (log: {self.log_path})"
                )
            time.sleep(0.2)

    def start(self, timeout_s: float = 900) -> Engine:
        # No launcher watchdog unless a test asks for one (tests/test_hang.py): its idle-time probe requests would
        # land between a test's reads of the engine's own counters, and in a benchmark's measurements.
        # vLLM's INFO lines are the tests' evidence ("Using V2 Model Runner", the kernel it selected): a level or
        # stream left in this process's environment (e.g. by `python -m mmcpu.kernels` run in-process) must not
        # silence them.
        env = dict(
            os.environ,
            MMCPU_HOST="127.0.0.1",
            MMCPU_RUNNER=self.runner,
            HF_HUB_OFFLINE="1",
            MMCPU_KERNEL_STATS=str(self.kernel_stats_path),
            MMCPU_WATCHDOG_INTERVAL_S="0",
            VLLM_LOGGING_LEVEL="INFO",
        )
        env.pop("VLLM_LOGGING_STREAM", None)
        env.update(self.env)
        self.kernel_stats_path.unlink(missing_ok=True)  # a previous run's counts must not stand in for these
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.pythonpath), env.get("PYTHONPATH")]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(self.python or sys.executable),
            "-m",
            "mmcpu.launch",
            "--model",
            str(self.model),
            "--port",
            str(self.port),
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.vllm_args:
            cmd += ["--", *self.vllm_args]
        t0, self.started_at = time.monotonic(), time.time()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        STARTS.append((self.log_path.stem, self.ready_s))
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        wait_until_ok(f"{self.base_url}/health", self.proc, timeout_s, f"vLLM for {self.model}", self.log_path)

    def client(self, timeout_s: float = 300) -> openai.OpenAI:
        # max_retries=0: a failing request must show up as the failure it is, not be retried into another.
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def samples(self, *names: str) -> dict[str, float]:
        """Samples of the engine's own /metrics (e.g. ``vllm:num_requests_running``), each summed over its label
        sets, from one read (counters read together are from the same moment)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out = dict.fromkeys(names, 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in out:
                    out[s.name] += s.value
        return out

    def sample(self, name: str) -> float:
        return self.samples(name)[name]

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its children (API process + engine core)."""
        return tree_rss(self.proc.pid if self.proc and self.proc.poll() is None else None)

    def stop(self) -> None:
        stop_group(self.proc, timeout_s=30)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Test engines' multimodal processor cache (MMCPU_MM_CACHE_GIB): ~31 Whisper windows, so a test session's traffic
# runs through eviction too, and tests/test_mm_cache.py can fill it many times over in seconds.
TEST_MM_CACHE_GIB = 0.03


def test_engine(model: Path, logs_dir: Path, tag: str, **kwargs: Any) -> Engine:
    """An Engine as the test sessions run them: the log ``logs_dir/<model>-<tag>.log``, the small mm cache."""
    kwargs["env"] = {"MMCPU_MM_CACHE_GIB": str(TEST_MM_CACHE_GIB), **kwargs.get("env", {})}
    return Engine(model=model, log_path=logs_dir / f"{model.name}-{tag}.log", **kwargs)


test_engine.__test__ = False  # a builder, not a pytest test


def served_dtype(model: Path) -> str:
    """The dtype an Engine serves ``model`` in on this CPU without MMCPU_DTYPE (mmcpu-serve's choice from the per-CPU
    table): a test that needs a float32 engine can take a session's engine when this is float32, not start another."""
    from mmcpu import launch
    from mmcpu.config import get_settings

    return launch.EngineSpec("engine", str(model), 0).choose(get_settings(), from_table=False).dtype


@dataclass(frozen=True)
class KernelCounts:
    """One snapshot of an engine's MRV2 kernel launches, per kernel (mmcpu.kernels.dispatch.StatsWriter)."""

    native: Counter
    interpreted: Counter
    time: float  # wall clock when the engine took it


def assert_native_then_stop(engine: Engine) -> KernelCounts:
    """A test session's end: every MRV2 kernel launch the engine made, warm-up and all the session's traffic, ran
    natively (none in Triton's interpreter); then stop it. Read from the engine while it runs, so vLLM's shutdown
    order cannot lose it."""
    try:
        counts = engine.kernel_counts()
    finally:
        engine.stop()
    assert sum(counts.native.values()) > 0, f"no native launch counted ({engine.kernel_stats_path})"
    assert not counts.interpreted, f"launches in Triton's interpreter: {dict(counts.interpreted)} ({engine.log_path})"
    return counts


class ServedApp:
    """A uvicorn server in a thread on 127.0.0.1 (a free port, or a given one to come back on after stop())."""

    def __init__(self, app: Any, port: int = 0, **config: Any) -> None:
        self.app = app
        self.port = port
        self.config = config  # more uvicorn.Config arguments, e.g. ssl_certfile / ssl_keyfile
        self.start()

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", timeout_graceful_shutdown=1, access_log=False, **self.config
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.thread.is_alive():
            raise RuntimeError("uvicorn did not stop within 10 s")

    @property
    def url(self) -> str:
        return f"{'https' if self.config.get('ssl_certfile') else 'http'}://127.0.0.1:{self.port}"


# The client key of the gateways tests put in front of their engines (tests/conftest.py, tests/test_hard_inputs.py).
GATEWAY_KEY = "test-client-key"


@contextlib.contextmanager
def gateway_for(**engines: Engine) -> Iterator[ServedApp]:
    """A gateway (in this process, on loopback, with a client key) in front of the given engines."""
    from mmcpu.config import Settings
    from mmcpu.gateway.app import create_app

    served = ServedApp(
        create_app(Settings(engines=",".join(f"{n}={e.base_url}" for n, e in engines.items()), api_key=GATEWAY_KEY))
    )
    try:
        yield served
    finally:
        served.stop()


class _Counted(BaseHTTPRequestHandler):
    """Answers every GET with a small JSON body (like an internal API) and counts it."""

    def do_GET(self) -> None:
        self.server.hits += 1  # type: ignore[attr-defined]
        body = b'{"object": "list", "data": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def counting_http_server(host: str = "127.0.0.1") -> Iterator[ThreadingHTTPServer]:
    """An open port on loopback standing for an internal service: ``.hits`` counts the requests it got (a media
    URL pointing at it must leave it at 0); ``.server_address[1]`` is its port."""
    server = ThreadingHTTPServer((host, 0), _Counted)
    server.daemon_threads = True
    server.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    return free_port()
