"""mmcpu.healthcheck (the image's HEALTHCHECK) against real local HTTP servers that behave like vLLM / the gateway.

A fake engine answers /health, /metrics (token counters), /v1/models and the 1-token probe routes; the tests make
it dead (503), hung (the probe never returns while the test runs), busy (counters moving) and check the verdicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeEngine:
    def __init__(self, *, health: int = 200, hung: bool = False, ping: int = 404):
        self.health = health
        self.hung = hung  # the 1-token probe never answers (until the fake is closed)
        self.closed = threading.Event()
        self.ping = ping
        self.tokens = 0
        self.probes: list[str] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def reply(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self.reply(engine.health)
                elif self.path == "/ping":
                    self.reply(engine.ping, b'{"status":"ok"}')
                elif self.path == "/metrics":
                    text = (
                        f'vllm:prompt_tokens_total{{model_name="m"}} {engine.tokens}.0\n'
                        f'vllm:generation_tokens_total{{model_name="m"}} {engine.tokens // 2}.0\n'
                    )
                    self.reply(200, text.encode(), "text/plain")
                elif self.path == "/v1/models":
                    self.reply(200, json.dumps({"data": [{"id": "fake-model"}]}).encode())
                else:
                    self.reply(404)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                engine.probes.append(self.path)
                if engine.hung:
                    engine.closed.wait(120)  # as long as the test runs: the check has long given up by then
                    return
                if self.path == "/v1/completions":
                    assert json.loads(body)["max_tokens"] == 1
                elif self.path == "/v1/audio/transcriptions":
                    assert b'name="max_completion_tokens"\r\n\r\n1' in body and b"RIFF" in body
                else:
                    return self.reply(404)
                engine.tokens += 2
                self.reply(200, b'{"text": ""}')

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    started: list[FakeEngine] = []

    def start(**kwargs) -> FakeEngine:
        started.append(FakeEngine(**kwargs))
        return started[-1]

    yield start
    for fake in started:
        fake.close()


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs: bound, never listening. Unlike a
    port found free and let go, no other process (nor an outgoing connection's own source port) can take it
    meanwhile and answer in its place."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def run_check(
    tmp_path,
    *role: str,
    gateway: int | None = None,
    audio: int | None = None,
    vision: int | None = None,
    probe_s: float = 2,
    health_timeout_s: float = 2,
) -> subprocess.CompletedProcess:
    with silent_port() as idle_gateway, silent_port() as idle_audio, silent_port() as idle_vision:
        env = dict(
            os.environ,
            MMCPU_GATEWAY_PORT=str(gateway or idle_gateway),
            MMCPU_AUDIO_PORT=str(audio or idle_audio),
            MMCPU_VISION_PORT=str(vision or idle_vision),
            MMCPU_HEALTH_PROBE_S=str(probe_s),
            MMCPU_HEALTH_TIMEOUT_S=str(health_timeout_s),
        )
        # The check keeps its progress state and reads the role file under /tmp; point both at the test's dir.
        code = (
            "import sys, pathlib, mmcpu.health as h, mmcpu.healthcheck as c; h.STATE_DIR = pathlib.Path(sys.argv[1]); "
            "h.ROLE_FILE = h.STATE_DIR / 'role'; sys.argv = sys.argv[1:]; sys.exit(c.main())"
        )
        return subprocess.run(
            [sys.executable, "-c", code, str(tmp_path), *role], env=env, capture_output=True, text=True, timeout=60
        )


def test_engine_healthy_after_a_one_token_probe(fakes, tmp_path):
    engine = fakes()
    result = run_check(tmp_path, "vision", vision=engine.port)
    assert result.returncode == 0, result.stdout
    assert "1-token probe" in result.stdout
    assert engine.probes == ["/v1/completions"]


def test_audio_engine_probe_is_a_one_token_transcription(fakes, tmp_path):
    engine = fakes()
    result = run_check(tmp_path, "audio", audio=engine.port)
    assert result.returncode == 0, result.stdout
    assert engine.probes == ["/v1/audio/transcriptions"]


def test_dead_engine_core_is_unhealthy(fakes, tmp_path):
    engine = fakes(health=503)  # vLLM's /health once the EngineCore died
    result = run_check(tmp_path, "audio", audio=engine.port)
    assert result.returncode == 1
    assert "HTTP 503" in result.stdout


def test_hung_engine_core_is_unhealthy_within_the_probe_timeout(fakes, tmp_path):
    # /health says 200 (vLLM's check_health only reads an "errored" flag), but nothing finishes.
    # Baseline: the same check against an engine that answers at once (interpreter start, imports, the same
    # requests), so the hung run's extra time is what the probe waited, whatever the speed of this machine.
    quick = fakes()
    t0 = time.monotonic()
    assert run_check(tmp_path, "vision", vision=quick.port, probe_s=1, health_timeout_s=30).returncode == 0
    baseline = time.monotonic() - t0
    engine = fakes(hung=True)
    t0 = time.monotonic()
    result = run_check(tmp_path, "vision", vision=engine.port, probe_s=1, health_timeout_s=30)
    extra = time.monotonic() - t0 - baseline
    assert result.returncode == 1, result.stdout
    assert "timed out" in result.stdout
    # The probe's own 1 s ended it: waiting for the engine (never) or on the 30 s health timeout would add >= 30 s;
    # 10 s of the margin absorb the noise between two runs of a fresh interpreter on a busy machine.
    assert extra < 1 + 10, (extra, baseline)


def test_busy_engine_making_progress_gets_no_extra_request(fakes, tmp_path):
    engine = fakes()
    assert run_check(tmp_path, "vision", vision=engine.port).returncode == 0
    engine.tokens += 50  # real traffic between two checks
    result = run_check(tmp_path, "vision", vision=engine.port)
    assert result.returncode == 0
    assert "progress" in result.stdout
    assert engine.probes == ["/v1/completions"]  # only the first check probed
    # No progress since: probe again (an idle engine may have hung meanwhile).
    assert run_check(tmp_path, "vision", vision=engine.port).returncode == 0
    assert len(engine.probes) == 2


def test_probe_off_checks_health_only(fakes, tmp_path):
    engine = fakes(hung=True)
    result = run_check(tmp_path, "vision", vision=engine.port, probe_s=0)
    assert result.returncode == 0, result.stdout
    assert engine.probes == []


def test_gateway_role_checks_the_gateways_own_ping(fakes, tmp_path):
    gateway = fakes(ping=200, health=503)  # engines behind it down: still alive itself
    result = run_check(tmp_path, "gateway", gateway=gateway.port)
    assert result.returncode == 0, result.stdout
    broken = fakes(ping=500)
    assert run_check(tmp_path, "gateway", gateway=broken.port).returncode == 1


def test_named_role_whose_port_does_not_listen_is_unhealthy(tmp_path):
    result = run_check(tmp_path, "audio")
    assert result.returncode == 1
    assert "not listening" in result.stdout


def test_role_from_the_entrypoints_role_file(fakes, tmp_path):
    engine = fakes(health=503)
    (tmp_path / "role").write_text("vision")
    result = run_check(tmp_path, vision=engine.port)
    assert result.returncode == 1 and "vision" in result.stdout


def test_without_a_role_only_listening_ports_count(fakes, tmp_path):
    engine = fakes()
    result = run_check(tmp_path, vision=engine.port)
    assert result.returncode == 0, result.stdout
    assert "audio" not in result.stdout and "gateway" not in result.stdout
    assert run_check(tmp_path).stdout.strip() == "no port answers yet"
