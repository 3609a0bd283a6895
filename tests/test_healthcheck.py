"""mmcpu.healthcheck (the image's HEALTHCHECK) against real local HTTP servers on free ports."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmcpu.servers import free_port


def serve(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_check(gateway: int, audio: int, vision: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, MMCPU_PORT=str(gateway), MMCPU_AUDIO_PORT=str(audio), MMCPU_VISION_PORT=str(vision))
    return subprocess.run([sys.executable, "-m", "mmcpu.healthcheck"], env=env, capture_output=True, text=True)


@pytest.fixture
def servers():
    started: list[ThreadingHTTPServer] = []

    def start(status: int) -> int:
        started.append(serve(status))
        return started[-1].server_address[1]

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_single_role_healthy_when_its_port_answers_200(servers):
    result = run_check(free_port(), servers(200), free_port())
    assert result.returncode == 0, result.stdout
    assert "audio" in result.stdout and "=ok" in result.stdout


def test_unhealthy_when_a_served_port_is_not_200(servers):
    result = run_check(servers(503), servers(200), servers(200))
    assert result.returncode == 1
    assert "gateway" in result.stdout and "HTTP 503" in result.stdout


def test_unhealthy_when_nothing_listens_yet():
    result = run_check(free_port(), free_port(), free_port())
    assert result.returncode == 1
    assert "no port answers yet" in result.stdout
