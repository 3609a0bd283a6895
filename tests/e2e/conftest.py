"""Session fixtures of the docker e2e tests: the run's config, the docker client and compose command, the figures
file, the images (built by ``scripts/docker-e2e images`` first), and one compose stack per image."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmcpu_dev import lines as release_lines

from .harness import LOGS, REPO_ROOT, Config, Docker, Figures, Stack, run, say, wait_for


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest's per-test timeout (pyproject: 1800 s) counts a module's stack start in its first test; the waits here
    # are bounded one by one (E2E_TIMEOUT_S, E2E_RESTART_S), so this is only the net under them.
    cfg = Config.from_env()
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(cfg.timeout_s + 3 * cfg.restart_s))


@pytest.fixture(scope="session")
def cfg() -> Config:
    return Config.from_env()


@pytest.fixture(scope="session", autouse=True)
def e2e_log() -> None:
    """The progress lines into .cache/logs/e2e/e2e.log too (make e2e also shows them live: log_cli)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(LOGS / "e2e.log", mode="w")
    handler.setFormatter(logging.Formatter("[e2e %(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("e2e")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # Every probe would be an INFO line of httpx's.
    for noisy in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    yield
    logger.removeHandler(handler)
    handler.close()


@pytest.fixture(scope="session")
def docker(cfg: Config) -> Docker:
    client = Docker(cfg.docker)
    if client("info", check=False).returncode != 0:
        pytest.fail(f"no docker engine answers {cfg.docker} (scripts/docker-engine start; make e2e starts one)")
    return client


@pytest.fixture(scope="session")
def compose(docker: Docker) -> list[str]:
    command = docker.compose_command()
    version = run([*command, "version", "--short"], timeout=60, check=False).stdout.strip()
    say(f"compose: {' '.join(command)} ({version or '?'})")
    return command


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures(LOGS / "figures.txt")


@dataclass(frozen=True)
class Images:
    patched: str
    unpatched: str
    smoke: str

    @property
    def all(self) -> list[str]:
        return [self.patched, self.unpatched, self.smoke]


@pytest.fixture(scope="session")
def images(cfg: Config, docker: Docker) -> Images:
    """The three images; make e2e builds them before this run. A stale one (built from other inputs) is said."""
    images = Images(cfg.image, cfg.image_unpatched, cfg.image_smoke)
    missing = [tag for tag in images.all if docker.inspect(tag) is None]
    if missing:
        pytest.fail(f"images missing: {missing} (make e2e, or scripts/docker-e2e images, builds them)")
    for name, tag in zip(("patched", "unpatched", "smoke"), images.all, strict=False):
        if run([str(REPO_ROOT / "scripts" / "docker-e2e"), "current", name], timeout=300, check=False).returncode:
            say(f"warning: {tag} was built from other inputs than the working tree's (make e2e rebuilds it first)")
    return images


@pytest.fixture(scope="module")
def patched_stack(cfg: Config, docker: Docker, compose: list[str], figures: Figures, images: Images):
    """The test stack with the patched image, detached (so single services can be killed and stopped), serving and
    healthy; torn down after its module (no two stacks share the host's 2 cores and memory)."""
    # The settings the unpatched run sets must not leak in from the caller's shell either.
    env = {"MMCPU_HEALTH_PROBE_S": None, "MMCPU_RESTART": None, "MMCPU_KERNELS": None}
    with Stack("patched", images.patched, cfg, docker, compose, figures, env) as stack:
        say(f"stack patched ({images.patched}) on {stack.gateway}")
        up = stack.compose_background(
            "up", "-d", "--no-build", "--no-color", "audio", "vision", "gateway", log_path=LOGS / "stack-patched.log"
        )
        with up:

            def serving() -> bool:
                if up.proc.poll():  # ended, and not with 0: nothing will come up
                    raise AssertionError(f"compose up -d failed: {up.output()[-2000:]}")
                return stack.serving()

            wait_for("the gateway serving", serving, cfg.timeout_s)
            figures.add("patched: compose up -> gateway serving (a model answers)", f"{stack.elapsed():.0f}s")
            stack.wait_all_healthy(cfg.timeout_s)
            rc = up.wait(timeout=300)
            assert rc == 0, f"compose up -d failed: {up.output()[-2000:]}"
        say(f"stack patched: healthy after {stack.elapsed():.0f}s")
        yield stack


@dataclass(frozen=True)
class UnpatchedRun:
    exit_code: int | None  # compose's (the smoke's); None when it did not end within E2E_TIMEOUT_S
    smoke_lines: list[str]
    audio_log: str
    vision_log: str


@pytest.fixture(scope="module")
def unpatched_run(cfg: Config, docker: Docker, compose: list[str], figures: Figures, images: Images) -> UnpatchedRun:
    """The test stack with the image without the seed patches, in the foreground until the smoke ends it.
    The smoke's requests must be the first the engines see (no 1-token health probe), and nothing restarts: each
    engine exits after its first failing request, which ends the stack (--exit-code-from implies
    --abort-on-container-exit)."""
    # The proof line's settings (no native MRV2 kernels: its image says MMCPU_KERNELS=interpreter). compose.yaml passes
    # every MMCPU_* setting through from the shell, empty when unset there, which would win over the image's.
    env = {"MMCPU_HEALTH_PROBE_S": "0", "MMCPU_RESTART": "no", **release_lines.PROOF_ENV}
    log_path = LOGS / "stack-unpatched.log"
    with Stack("unpatched", images.unpatched, cfg, docker, compose, figures, env) as stack:
        say(f"stack unpatched ({images.unpatched}) on {stack.gateway}; the smoke must fail (log {log_path})")
        try:
            code = stack.compose(
                "up",
                "--no-build",
                "--no-color",
                "--exit-code-from",
                "smoke",
                log_path=log_path,
                timeout=cfg.timeout_s,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
        # compose prefixes each line with its service ("smoke_1  | [smoke] ..."); the smoke's own lines are wanted.
        text = log_path.read_text(errors="replace")
        lines = [line.split("| ", 1)[-1] for line in text.splitlines() if "[smoke]" in line]
        for line in lines:
            say(line)
    figures.add(
        "unpatched: smoke result",
        f"exit {code}; {sum(' PASS ' in line for line in lines)} PASS / {sum(' FAIL ' in line for line in lines)} FAIL",
    )
    return UnpatchedRun(code, lines, stack.logs["audio"], stack.logs["vision"])
