"""The images as built: no CA of the build host in any layer, a runtime without compilers that says so at once."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from .harness import LOGS, REPO_ROOT, Config, Docker, Figures, run, say

pytestmark = pytest.mark.e2e

CHECK_SECRETS = str(REPO_ROOT / "scripts" / "check-image-secrets")
CONTROL = "mmcpu-e2e-leak:control"


def test_no_build_host_ca_in_any_layer(cfg: Config, docker: Docker, images, figures: Figures, tmp_path: Path):
    """scripts/check-image-secrets streams `docker save` and searches every file of every layer; it must pass on
    the three images and catch the mistake it exists for: a RUN step that copies the secret away."""
    t0 = time.monotonic()
    scan = [CHECK_SECRETS, "--docker", cfg.docker, "--ca", str(cfg.ca_bundle)]
    result = run([*scan, *images.all], timeout=3600, log_path=LOGS / "secrets.log", check=False)
    found = [line for line in (LOGS / "secrets.log").read_text().splitlines() if "FOUND" in line]
    assert result.returncode == 0, f"CA material in an image layer: {found[:10]} (log {LOGS / 'secrets.log'})"
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm-slim\n"
                                         "RUN --mount=type=secret,id=ca cp /run/secrets/ca /tmp/leaked\n")
    docker("build", "-q", "--secret", f"id=ca,src={cfg.ca_bundle}", "-t", CONTROL, str(tmp_path), timeout=900)
    try:
        caught = run([*scan, CONTROL], timeout=900, check=False).returncode != 0
    finally:
        docker("rmi", CONTROL, check=False)
    assert caught, "check-image-secrets missed a deliberately leaked CA bundle"
    say("secrets: images clean; the deliberately leaking control image was caught")
    figures.add("secrets scan (3 images + control)", f"{time.monotonic() - t0:.0f}s")


def run_image(docker: Docker, image: str, *args: str, timeout: float = 600):
    """`docker run --rm` of the image, named so that a run cut short by the timeout is removed too."""
    name = f"mmcpu-e2e-run-{uuid.uuid4().hex[:8]}"
    try:
        return run([docker.binary, "run", "--rm", "--name", name, *args], timeout=timeout, check=False, merge=True)
    finally:
        docker("rm", "-f", name, check=False)


def test_runtime_is_non_root_without_build_tools(docker: Docker, images):
    result = run_image(docker, images.patched, "--entrypoint", "sh", images.patched, "-c",
                       "id -u; for t in gcc cc g++ c++ clang make as ld; do command -v $t; done; true")
    lines = result.stdout.split()
    assert lines[:1] == ["10001"], f"the runtime does not run as uid 10001: {result.stdout}"
    assert lines[1:] == [], f"the runtime has build tools: {lines[1:]}"


@pytest.mark.parametrize("setting", ["MMCPU_RUNNER=v1", "MMCPU_COMPILE=1"])
def test_runtime_refuses_settings_that_need_a_compiler(docker: Docker, images, figures: Figures, setting: str):
    """Refused at once, in one line, exit 2 (not minutes into vLLM's start-up)."""
    result = run_image(docker, images.patched, "-e", setting, images.patched, "audio")
    key, value = setting.split("=")
    assert result.returncode == 2, f"{setting}: the runtime exited {result.returncode}, not 2: {result.stdout}"
    assert f"audio: refusing to start: {key}={value} needs a C++ compiler" in result.stdout, result.stdout
    figures.add(f"runtime: {setting}", "refused at start (exit 2, one line; no C++ compiler)")


def test_patch_tool_works_in_the_image_without_arguments(docker: Docker, images):
    """The shipped patches are found without --patches: check passes, status lists every one applied."""
    check = run_image(docker, images.patched, "--entrypoint", "vllm-patch", images.patched, "check")
    assert check.returncode == 0, f"vllm-patch check in the runtime image failed: {check.stdout}"
    status = run_image(docker, images.patched, "--entrypoint", "vllm-patch", images.patched, "status")
    lines = status.stdout.strip().splitlines()
    assert lines and all(line.endswith((": applied", ": upstream")) for line in lines), status.stdout
    say(f"vllm-patch status/check work in the image without arguments ({len(lines)} patches applied)")
