"""mmcpu_dev.wheels: the one fetch-and-extract helper (fixture models, pristine vLLM files, unpatched overlay)."""

from __future__ import annotations

import zipfile

import pytest

from mmcpu_dev import wheels


@pytest.fixture
def cached_wheel(tmp_path):
    path = tmp_path / "wheels" / "some_pkg-1.0-py3-none-any.whl"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("some_pkg/__init__.py", "x = 1\n")
        zf.writestr("some_pkg/data/model.bin", b"\x00\x01")
        zf.writestr("some_pkg-1.0.dist-info/METADATA", "Name: some-pkg\n")
    return path


def test_fetch_uses_the_cache_and_checks_the_digest(cached_wheel):
    # A cached wheel is used as it is (no pip run: the requirement does not exist on PyPI).
    assert wheels.fetch("some-pkg==1.0", cached_wheel.parent) == cached_wheel
    good = wheels.sha256(cached_wheel)
    assert wheels.fetch("some-pkg==1.0", cached_wheel.parent, expect_sha256=good) == cached_wheel
    with pytest.raises(wheels.WheelError, match="expected 0000"):
        wheels.fetch("some-pkg==1.0", cached_wheel.parent, expect_sha256="0" * 64)


def test_fetch_failure_is_one_clear_error(tmp_path, monkeypatch):
    # An index that refuses connections (loopback, nothing listening): pip fails, fetch says so in one error.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(wheels.WheelError, match="pip download mmcpu-no-such-package-xyz==0.0.1 failed"):
        wheels.fetch("mmcpu-no-such-package-xyz==0.0.1", tmp_path)


def test_extract_by_names_or_predicate(cached_wheel, tmp_path):
    out = tmp_path / "out"
    assert wheels.extract(cached_wheel, out, ["some_pkg/__init__.py", "absent.py"]) == ["some_pkg/__init__.py"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["some_pkg/__init__.py"]
    wheels.extract(cached_wheel, out, lambda name: name.startswith("some_pkg/"))
    assert (out / "some_pkg/data/model.bin").read_bytes() == b"\x00\x01"
    assert not (out / "some_pkg-1.0.dist-info").exists()
