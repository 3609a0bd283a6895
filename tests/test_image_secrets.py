"""scripts/check-image-secrets must catch each way the build host's CA could end up in an image, and pass a build
that only mounted it as a BuildKit secret. Small real images on debian:bookworm-slim (scripts/seed-base-image)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mmcpu.config import REPO_ROOT

pytestmark = pytest.mark.slow
CA = Path("/etc/ssl/certs/ca-certificates.crt")
PUBLIC_ROOT = next(Path("/usr/share/ca-certificates/mozilla").glob("*.crt"), None)
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    subprocess.run([REPO_ROOT / "scripts/docker-engine"], check=True)
    subprocess.run([REPO_ROOT / "scripts/seed-base-image"], check=True)
    tags = []

    def run(name: str, dockerfile: str, files: dict[str, Path] | None = None) -> str:
        ctx = tmp_path_factory.mktemp(name)
        (ctx / "Dockerfile").write_text(dockerfile)
        for target, source in (files or {}).items():
            shutil.copyfile(source, ctx / target)
        tag = f"mmcpu-test-secrets:{name}"
        subprocess.run(
            [DOCKER, "build", "-q", "--secret", f"id=ca,src={CA}", "-t", tag, str(ctx)],
            check=True,
            env=dict(os.environ, DOCKER_BUILDKIT="1"),
            stdout=subprocess.DEVNULL,
        )
        tags.append(tag)
        return tag

    yield run
    subprocess.run([DOCKER, "rmi", *tags], stdout=subprocess.DEVNULL, check=False)


def check(tag: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REPO_ROOT / "scripts/check-image-secrets", "--docker", DOCKER, "--ca", str(CA), tag],
        capture_output=True,
        text=True,
    )


def test_secret_mount_only_is_clean(build):
    tag = build("mounted", "FROM debian:bookworm-slim\nRUN --mount=type=secret,id=ca wc -c /run/secrets/ca\n")
    result = check(tag)
    assert result.returncode == 0, result.stdout + result.stderr


def test_secret_copied_out_of_the_mount_is_found(build):
    tag = build("leak", "FROM debian:bookworm-slim\nRUN --mount=type=secret,id=ca cp /run/secrets/ca /opt/bundle\n")
    result = check(tag)
    assert result.returncode == 1
    assert "opt/bundle: IS the build host's CA bundle" in result.stdout


def test_host_ca_under_another_name_is_found(build):
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    assert extra, "this host has no local CA; the test needs one to hide"
    tag = build("renamed", "FROM debian:bookworm-slim\nCOPY x /usr/share/doc/notes.txt\n", {"x": extra[0]})
    result = check(tag)
    assert result.returncode == 1
    assert "usr/share/doc/notes.txt: contains host CA" in result.stdout


def test_unowned_certificate_file_is_found(build):
    assert PUBLIC_ROOT, "no Debian public roots on this host (apt-get install ca-certificates)"
    tag = build("pem", "FROM debian:bookworm-slim\nCOPY x /etc/myapp/trust.pem\n", {"x": PUBLIC_ROOT})
    result = check(tag)
    assert result.returncode == 1
    assert "etc/myapp/trust.pem: certificate/key file that no package installed" in result.stdout
