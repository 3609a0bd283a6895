"""mmcpu.kernels.check: what the image build and the engine's start refuse, the CLI's output, and the stamp that
keeps the start cheap (the full check imports vLLM's kernel modules, ~10 s of CPU).

The problems are made by editing the registry and the classification for one test (monkeypatch), on the real
installed vLLM's kernels; the stamp tests use a small fake vLLM directory.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from mmcpu.kernels import __main__ as cli
from mmcpu.kernels import check, dispatch, reachability

GUMBEL = ("vllm.v1.worker.gpu.sample.gumbel", "_gumbel_sample_kernel")
MIN_P = ("vllm.v1.worker.gpu.sample.min_p", "_min_p_kernel")
BAD_WORDS = "vllm.v1.worker.gpu.sample.bad_words:_bad_words_kernel"


@pytest.fixture(autouse=True)
def native_mode(monkeypatch):
    """The CLI checks native versions only in MMCPU_KERNELS=native (the default): whatever the caller's setting."""
    monkeypatch.delenv("MMCPU_KERNELS", raising=False)


@pytest.fixture
def broken(monkeypatch):
    """Three kinds of problem: a stale guard (gumbel), no native version (min_p), a kernel nobody classified."""
    dispatch.load_native_modules()
    monkeypatch.setitem(
        dispatch.REGISTRY, GUMBEL, dataclasses.replace(dispatch.REGISTRY[GUMBEL], source_sha256="0" * 64)
    )
    monkeypatch.delitem(dispatch.REGISTRY, MIN_P)
    monkeypatch.delitem(reachability.KERNELS, BAD_WORDS)
    return {
        ":".join(GUMBEL): "kernel source changed",
        ":".join(MIN_P): "no native implementation",
        BAD_WORDS: "not classified",
    }


def test_each_problem_is_named_with_its_reason(broken):
    result = check.run()
    got = {p.kernel: p.line() for p in result.problems}
    assert set(got) == set(broken)
    for kernel, why in broken.items():
        assert got[kernel].startswith(f"{kernel}: ") and why in got[kernel] and "\n" not in got[kernel]
    assert "would run in Triton's interpreter" in got[":".join(GUMBEL)]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A vLLM package dir with the files the fingerprint reads (check.vllm_dir() answers it)."""
    vdir = tmp_path / "site" / "vllm"
    for rel in (
        "v1/worker/gpu/__init__.py",
        "v1/worker/gpu/sample/gumbel.py",
        "v1/worker/utils.py",
        "v1/sample/ops/topk_topp_triton.py",
    ):
        (vdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (vdir / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(check, "vllm_dir", lambda: vdir)
    return vdir


def test_cli_prints_one_line_per_problem_and_exits_2(broken, fake_vllm, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # the CLI's own default, undone after the test: engines
    # started later in this process inherit os.environ and must keep vLLM's INFO lines (their MRV2 evidence)
    assert cli.main(["check"]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 3 and {ln.split(": ")[0] for ln in lines} == set(broken)
    assert "3 problem(s)" in err
    assert check.read_stamp(fake_vllm) == lines  # the start reads the same lines


def test_cli_passes_on_the_installed_vllm(fake_vllm, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # the CLI's own default, undone after the test: engines
    # started later in this process inherit os.environ and must keep vLLM's INFO lines (their MRV2 evidence)
    assert cli.main(["check"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and f"all {len(reachability.reachable())} reachable MRV2 kernels" in err
    assert check.read_stamp(fake_vllm) == []


def test_stamp_is_valid_until_a_file_it_depends_on_changes(fake_vllm, tmp_path):
    extra = tmp_path / "helpers.py"
    extra.write_text("x = 1\n")
    gumbel = fake_vllm / "v1/worker/gpu/sample/gumbel.py"
    assert check.write_stamp(fake_vllm, check.Result([check.Problem("m:k", "why")], 1, [str(extra)]))
    assert check.read_stamp(fake_vllm) == ["m:k: why"]

    original = gumbel.read_text()
    gumbel.write_text(original + "# changed\n")  # a kernel module changed
    assert check.read_stamp(fake_vllm) is None
    gumbel.write_text(original)  # content decides, not the mtime
    assert check.read_stamp(fake_vllm) == ["m:k: why"]

    new = fake_vllm / "v1/worker/gpu/new_kernels.py"  # a new module (new kernels) under the scanned package
    new.write_text("")
    assert check.read_stamp(fake_vllm) is None
    new.unlink()
    extra.write_text("x = 2\n")  # a file the guards read, outside the scanned package
    assert check.read_stamp(fake_vllm) is None
    extra.write_text("x = 1\n")
    assert check.read_stamp(fake_vllm) == ["m:k: why"]

    check.stamp_path(fake_vllm).write_text("{not json")
    assert check.read_stamp(fake_vllm) is None


def test_stamp_covers_mmcpus_kernels():
    assert check.KERNELS_DIR / "reachability.py" in set(check.KERNELS_DIR.rglob("*.py"))
    assert check.KERNELS_DIR / "sample" / "gumbel.py" in set(check.KERNELS_DIR.rglob("*.py"))


def test_unwritable_stamp_is_not_an_error(fake_vllm, monkeypatch):
    monkeypatch.setattr(check, "stamp_path", lambda vdir: vdir / "no-such-dir" / check.STAMP_NAME)
    assert check.write_stamp(fake_vllm, check.Result([], 0, [])) is False


def test_cached_reads_a_fresh_stamp_without_running_the_check(fake_vllm, monkeypatch):
    check.write_stamp(fake_vllm, check.Result([check.Problem("m:k", "why")], 1, []))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the check ran"))
    problems, how = check.cached(on_run=lambda: pytest.fail("said it would run"))
    assert problems == ["m:k: why"] and how.startswith("stamp ")


@pytest.mark.parametrize(
    "code,stdout,stderr,expected",
    [
        (0, "", "all fine\n", []),
        (2, "a:b: stale\nc:d: gone\n", "2 problem(s)\n", ["a:b: stale", "c:d: gone"]),
        (
            1,
            "",
            "Traceback...\nImportError: no vllm\n",
            ["`python -m mmcpu.kernels check` failed (exit 1): ImportError: no vllm"],
        ),
    ],
)
def test_cached_runs_the_check_in_a_subprocess_without_a_stamp(fake_vllm, monkeypatch, code, stdout, stderr, expected):
    calls, notices = [], []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    monkeypatch.setattr(subprocess, "run", fake_run)
    problems, how = check.cached(on_run=lambda: notices.append(1))
    assert problems == expected and how == "subprocess"
    assert calls == [[sys.executable, "-m", "mmcpu.kernels", "check"]] and notices == [1]


def test_no_vllm_is_one_problem(monkeypatch):
    def missing():
        raise check.CheckError("vllm is not installed for python")

    monkeypatch.setattr(check, "vllm_dir", missing)
    assert check.cached() == (["vllm is not installed for python"], "no vLLM")


def test_stamp_format(fake_vllm):
    check.write_stamp(fake_vllm, check.Result([], 26, []))
    data = json.loads(check.stamp_path(fake_vllm).read_text())
    assert data["version"] == 1 and data["reachable"] == 26 and data["problems"] == []
    assert not list(fake_vllm.glob("*.tmp"))


def test_cli_fails_without_the_plugin_entry_point(fake_vllm, monkeypatch, capsys):
    """An install where vLLM would not load mmcpu.plugin (not pip-installed) fails the check; a start reading the
    stamp would not see that, so there is none."""
    import importlib.metadata

    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # the CLI's own default, undone after the test: engines
    # started later in this process inherit os.environ and must keep vLLM's INFO lines (their MRV2 evidence)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert cli.main(["check"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "mmcpu.plugin:register: vllm.general_plugins entry point 'mmcpu' is missing: vLLM would not "
        "install the native kernels (pip install mmcpu)"
    ]
    assert check.read_stamp(fake_vllm) is None  # not stamped: the next start checks (and refuses) again


def test_cli_in_interpreter_mode_checks_only_the_plugin(broken, fake_vllm, monkeypatch, capsys):
    """MMCPU_KERNELS=interpreter (the proof line's mode): the stale / missing native versions do not matter, as at
    the engine's start; the CLI passes, says why, and leaves no stamp a native start could take for a pass."""
    import importlib.metadata

    monkeypatch.setenv("MMCPU_KERNELS", "interpreter")
    assert cli.main(["check"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "MMCPU_KERNELS=interpreter" in err
    assert check.read_stamp(fake_vllm) is None
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert cli.main(["check"]) == 2  # the plugin fills the interpreter's gaps: it must still be registered
    assert capsys.readouterr().out.startswith("mmcpu.plugin:register: ")
    monkeypatch.delenv("MMCPU_KERNELS")
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    # the entry points stay patched: native mode fails on them and on the kernels
    assert cli.main(["check"]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert {ln.split(": ")[0] for ln in lines} == set(broken) | {"mmcpu.plugin:register"}
