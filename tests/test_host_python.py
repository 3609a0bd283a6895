"""`make up` and `make down` run on a host with docker, make, bash and python3's standard library only: every
Python module the host scripts run must import and answer under ``python3 -I -S`` (no PYTHONPATH, no site-packages:
no venv's and no pip-installed package), here as in the scripts, so a third-party import fails at once on every
host instead of only where the package happens to be missing. Each fact is asked through the scripts' own wrapper."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from mmcpu_dev import shell

REPO_ROOT = Path(__file__).resolve().parents[1]
E2E = REPO_ROOT / "scripts" / "docker-e2e"
# The scripts `make up` / `make down` / CI's bare-host step run before any venv exists.
HOST_SCRIPTS = ["scripts/docker-e2e", "scripts/docker-engine", "scripts/seed-base-image", ".ci/run", ".ci/bare-host"]


def host_modules() -> set[str]:
    """Our modules the host scripts hand to Python: ``-m MOD`` and ``from MOD import NAME`` / ``import MOD`` in them."""
    found: set[str] = set()
    for script in HOST_SCRIPTS:
        text = (REPO_ROOT / script).read_text()
        for package, name in re.findall(r"\bfrom (mmcpu(?:_dev)?(?:\.\w+)*) import (\w+)", text):
            path = REPO_ROOT.joinpath(*package.split("."), name)  # NAME a module of PACKAGE, or a name in it
            found.add(f"{package}.{name}" if path.with_suffix(".py").is_file() or path.is_dir() else package)
        found.update(re.findall(r"(?:-m|\bimport) (mmcpu(?:_dev)?(?:\.\w+)+)", text))
    return found


def interpreters() -> list[str]:
    """This test's Python, the python3 the scripts find here and the distribution's, once each."""
    found = [sys.executable, shutil.which("python3") or sys.executable]
    found += [p for p in ("/usr/bin/python3",) if os.access(p, os.X_OK)]  # the distribution's, a bare host's
    return list({os.path.realpath(p): p for p in found}.values())


def import_isolated(python: str, module: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.path.append({str(REPO_ROOT)!r}); import {module}"
    return subprocess.run(
        [python, "-I", "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )


def test_the_host_scripts_name_their_modules():
    # The discovery is not vacuous: it finds the fact module (docker-e2e) and the CPU line (.ci/run).
    assert {"mmcpu_dev.shell", "mmcpu.cpu"} <= host_modules(), host_modules()


@pytest.mark.parametrize("python", interpreters())
def test_every_host_module_imports_with_the_standard_library_alone(python):
    modules = sorted(host_modules() | {"mmcpu.names"})
    for module in modules:
        result = import_isolated(python, module)
        assert result.returncode == 0, f"{module} under {python} -I -S:\n{result.stderr}"


def test_a_third_party_import_fails_there_even_where_the_package_is_installed():
    # The control: psutil is installed in this venv, yet mmcpu.proc (which imports it) fails under -I -S.
    assert importlib.util.find_spec("psutil") is not None
    result = import_isolated(sys.executable, "mmcpu.proc")
    assert result.returncode != 0 and "No module named 'psutil'" in result.stderr, result.stderr


def fact(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH naming this venv's site-packages (pydantic, psutil, ...) must not matter: -I ignores it.
    return subprocess.run(
        [str(E2E), "fact", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], **(env or {})},
    )


def test_each_fact_answers_through_the_scripts_wrapper():
    assert fact("served-name", "/models/whisper-tiny.en").stdout == "whisper-tiny.en\n"
    assert fact("served-name", "openai/whisper-tiny.en").stdout == "openai/whisper-tiny.en\n"
    assert fact("human", "2587654321").stdout == "2.41GiB\n"
    assert fact("human", "1536").stdout == "1.50KiB\n"
    assert 1024 <= int(fact("free-port").stdout) < 65536


def test_the_launcher_and_the_scripts_share_one_served_name_rule():
    from mmcpu import launch, names

    assert launch.served_name is names.served_name


class Health(http.server.BaseHTTPRequestHandler):
    """A gateway's /health as mmcpu/gateway/routes/ops.py answers it (the status code follows the status)."""

    body: dict = {}

    def do_GET(self):
        code = 503 if self.body.get("status") == "unavailable" else 200
        data = json.dumps(self.body).encode() if self.path == "/health" else b"{}"
        self.send_response(code if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def gateway():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_gateway_status_reads_health_including_a_503(gateway):
    url = f"http://127.0.0.1:{gateway.server_address[1]}"
    engines = {"audio": {"up": False, "models": []}, "vision": {"up": True, "models": ["tiny-llava"]}}
    Health.body = {"status": "degraded", "down": ["audio"], "engines": engines}
    assert fact("gateway-status", url).stdout == "degraded audio:down vision:up\n"
    Health.body = {
        "status": "unavailable",
        "down": ["audio", "vision"],
        "engines": {name: {"up": False} for name in engines},
    }
    assert fact("gateway-status", url).stdout == "unavailable audio:down vision:down\n"
    Health.body = {"unexpected": True}
    assert fact("gateway-status", url).stdout == "\n"
    with socket.socket() as closed:  # nothing listens: no answer, no error
        closed.bind(("127.0.0.1", 0))
        result = fact("gateway-status", f"http://127.0.0.1:{closed.getsockname()[1]}")
    assert result.returncode == 0 and result.stdout == "\n"


def test_check_port_names_a_port_in_use_and_passes_a_free_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = fact("check-port", "127.0.0.1", str(port))
        assert result.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in result.stdout
        assert "MMCPU_PUBLISH=127.0.0.1:" in result.stdout and len(result.stdout.splitlines()) == 1
        # All interfaces: a listener on one address takes the port from 0.0.0.0 too.
        result = fact("check-port", "0.0.0.0", str(port))
        assert result.returncode == 1 and "in use" in result.stdout
    assert fact("check-port", "127.0.0.1", str(port)).returncode == 0
    result = fact("check-port", "192.0.2.1", str(port))  # TEST-NET-1: not an address of this host
    assert result.returncode == 1 and "not an address of this host" in result.stdout


def test_memory_and_disk_checks_name_what_is_missing(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:    3145728 kB\n")
    assert shell.mem_available_gib(str(meminfo)) == 3.0
    assert shell.memory_problem(2.5, str(meminfo)) is None
    problem = shell.memory_problem(4, str(meminfo))
    assert problem.startswith("only 3.0 GiB of memory is available") and "UP_MIN_MEM_GIB=0" in problem
    assert shell.mem_available_gib(str(tmp_path / "absent")) is None  # no /proc: not measured, not refused
    assert fact("check-memory", "0.001").returncode == 0
    result = fact("check-memory", "100000")
    assert result.returncode == 1 and "GiB of memory is available" in result.stdout
    assert fact("check-disk", str(tmp_path), "0.001").returncode == 0
    result = fact("check-disk", str(tmp_path), "100000")
    assert (
        result.returncode == 1 and f"GiB free on {tmp_path}" in result.stdout and "UP_MIN_DISK_GIB=0" in result.stdout
    )
    assert fact("check-disk", str(tmp_path / "absent"), "100000").returncode == 0  # a remote engine's: unknown
