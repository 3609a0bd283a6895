"""`make up` on a host that lacks something: each missing piece is one line saying what to do and a non-zero exit,
before any long work (no build, no stack). The conditions are real ones made here: a PATH without docker or python3,
a port another program listens on, a socket this user may not open (``DOCKER_HOST``), an engine that does not
answer, and thresholds forced above what the host has."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
E2E = REPO_ROOT / "scripts" / "docker-e2e"
DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
HAS_COMPOSE = bool(shutil.which("docker-compose")) or (
    DOCKER is not None and subprocess.run([DOCKER, "compose", "version"], capture_output=True).returncode == 0
)
needs_docker_client = pytest.mark.skipif(not (DOCKER and HAS_COMPOSE), reason="no docker client and compose here")


def run(
    command: str = "up", *, env: dict[str, str] | None = None, script: Path = E2E, user: int | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    # A project of its own and a free port: a stack of this checkout (or another) must not count as ours.
    base = {
        **os.environ,
        "MMCPU_PROJECT": f"prereq-{uuid.uuid4().hex[:8]}",
        "IMAGE": "mmcpu:prereq-absent",
        "MMCPU_PUBLISH": f"127.0.0.1:{free_port()}",
        "HOME": tempfile.gettempdir(),
        "UP_MIN_DISK_GIB": "100000",
    }  # were a check to let the run through, it would stop there, not build
    t0 = time.monotonic()
    result = subprocess.run(
        [str(script), command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        user=user,
        group=user,
        extra_groups=[] if user else None,
    )
    return result, time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def the_line(result: subprocess.CompletedProcess[str], elapsed: float) -> str:
    """The run failed with exactly one error line, its last, and started nothing long."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "FAILED:" in line or "] error:" in line]
    assert result.returncode != 0, result.stderr
    assert len(errors) == 1 and errors[0] == lines[-1], result.stderr
    assert "] building " not in result.stderr and "] starting the stack" not in result.stderr, result.stderr
    assert elapsed < 60, f"{elapsed:.0f}s before the message"
    return errors[0]


def path_without(tmp_path: Path, *prefixes: str) -> str:
    """A PATH directory with every program of /usr/bin and /bin but those whose name starts with a prefix."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/bin", "/bin"):
        for program in Path(directory).iterdir():
            target = bin_dir / program.name
            if not program.name.startswith(prefixes) and not target.exists():
                target.symlink_to(program)
    return str(bin_dir)


@pytest.mark.parametrize("command", ["up", "down"])
def test_no_docker_client(tmp_path, command):
    env = {"PATH": path_without(tmp_path, "docker"), "DOCKER": str(tmp_path / "docker")}
    line = the_line(*run(command, env=env))
    assert "no docker client on this host: install Docker (Debian/Ubuntu: sudo apt-get install docker.io" in line


def test_no_python3(tmp_path):
    line = the_line(*run(env={"PATH": path_without(tmp_path, "python")}))
    assert "no python3 on this host: install Python 3" in line


@needs_docker_client
@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_port_in_use(bind):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        publish = f"127.0.0.1:{port}" if bind == "127.0.0.1" else str(port)  # the compose file's two forms
        line = the_line(*run(env={"MMCPU_PUBLISH": publish}))
    assert (
        f"port {port} on {bind} is in use by another program: stop it, or publish the gateway on another port" in line
    )
    assert "MMCPU_PUBLISH=" in line


@needs_docker_client
def test_too_little_memory():
    line = the_line(*run(env={"UP_MIN_MEM_GIB": "100000"}))
    assert "GiB of memory is available and the stack (two engines, the gateway) needs about 100000 GiB" in line
    assert "UP_MIN_MEM_GIB=0" in line


@needs_docker_client
def test_an_engine_elsewhere_that_does_not_answer(tmp_path):
    line = the_line(*run(env={"DOCKER_HOST": f"unix://{tmp_path}/absent.sock", "UP_MIN_MEM_GIB": "0"}))
    assert f"no docker engine answers at unix://{tmp_path}/absent.sock: start that engine, or unset DOCKER_HOST" in line


@needs_docker_client
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_no_permission_on_the_socket():
    """A user who may not open the engine's socket (mode 0600, root's), as a newcomer outside the docker group."""
    nobody = 65534
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # The files `make up` reads before the engine, in a tree the other user can read.
        for rel in (
            "scripts/docker-e2e",
            "scripts/docker-engine",
            "requirements/lines.env",
            "mmcpu/__init__.py",
            "mmcpu/names.py",
            "mmcpu_dev/__init__.py",
            "mmcpu_dev/shell.py",
        ):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, root / rel)
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        sock_path = root / "engine.sock"
        with socket.socket(socket.AF_UNIX) as engine:
            engine.bind(str(sock_path))
            engine.listen()
            sock_path.chmod(0o600)
            line = the_line(
                *run(
                    env={"DOCKER_HOST": f"unix://{sock_path}", "UP_MIN_MEM_GIB": "0"},
                    script=root / "scripts" / "docker-e2e",
                    user=nobody,
                )
            )
    assert f"no permission on the docker socket (unix://{sock_path}): add your user to the docker group" in line


@pytest.mark.slow  # needs the docker engine: the disk is measured where it keeps its data
@needs_docker_client
def test_too_little_disk_for_the_build():
    result, elapsed = run(env={"UP_MIN_DISK_GIB": "100000", "UP_MIN_MEM_GIB": "0"})
    line = the_line(result, elapsed)
    assert "is missing" in result.stderr  # the image must be built: that is when the disk counts
    assert "GiB free on" in line and "(Docker's data) and building the image needs about 100000 GiB" in line
