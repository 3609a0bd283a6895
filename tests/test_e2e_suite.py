"""The docker e2e suite's plumbing, without docker: scripts/docker-e2e's commands, tests/e2e collecting (marked
e2e, never part of `make test`), and the parsing its checks rest on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e.harness import docker_time, human

from mmcpu_dev.smoke import LOAD_RECORD, LOAD_SUMMARY, read_load

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "docker-e2e"


def test_script_parses_and_names_its_commands():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    result = subprocess.run([str(SCRIPT), "no-such-command"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    for command in ("prepare", "build NAME", "images", "figures", "current NAME", "up", "down", "serving"):
        assert command in result.stderr, result.stderr


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )


def test_e2e_suite_collects_marked_and_apart_from_make_test():
    # `pytest tests` (make test) with every other test file set aside: tests/e2e is not reached by itself.
    result = collect("tests", "--ignore-glob=tests/test_*.py", "--ignore=tests/kernels")
    assert "no tests collected" in result.stdout, result.stdout[-2000:]
    result = collect("-m", "not e2e", "tests/e2e")
    assert "no tests collected" in result.stdout and "deselected" in result.stdout, result.stdout[-2000:]
    result = collect("-m", "e2e", "tests/e2e")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any("test_hung_engine_core" in line for line in collected), collected
    assert any("test_unpatched_stack.py" in line for line in collected), collected


def test_read_load_takes_records_and_summary_and_skips_a_partial_line():
    record = {"i": 0, "kind": "audio", "sampling": False, "t0": 1.0, "ok": True, "t1": 2.0}
    summary = {"requests": 1, "failures": 0}
    output = "\n".join(
        [
            f"{LOAD_RECORD}{json.dumps(record)}",
            "[smoke] other",
            f"{LOAD_SUMMARY}{json.dumps(summary)}",
            f'{LOAD_RECORD}{{"i": 1, "ki',
        ]
    )
    assert read_load(output) == ([record], summary)
    assert read_load("") == ([], None)


def test_docker_times_and_sizes_as_the_figures_print_them():
    assert docker_time("0001-01-01T00:00:00Z") is None
    assert docker_time("1970-01-01T00:01:40.500000001Z") == 100.500000001
    assert human(512) == "512B"
    assert human(1.5 * 2**30) == "1.50GiB"
    assert human(95.98 * 2**20) == "95.98MiB"
