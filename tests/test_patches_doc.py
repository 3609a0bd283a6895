"""Patches are described once, in their headers and series: docs/patches.md's table is generated from them and
must be current (like the settings table, tests/test_settings_doc.py)."""

from __future__ import annotations

import re
import shutil

from mmcpu.config import REPO_ROOT
from mmcpu.patchtool import parse_patch
from mmcpu_dev import patches_doc

PATCHES = REPO_ROOT / "patches"


def test_docs_patch_table_is_generated_from_the_patches():
    assert patches_doc.main(["--check"]) == 0, "docs/patches.md is stale: run `make patches-doc`"


def test_every_patch_file_has_one_row_with_its_subject_and_group():
    table = patches_doc.table()
    files = sorted({p.name for p in PATCHES.glob("**/*.patch")})
    numbers = re.findall(r"^\| \[(\d{4})\]\(", table, flags=re.M)
    assert numbers == [name.split("-", 1)[0] for name in files]
    for name in files:
        p = parse_patch(PATCHES / name if (PATCHES / name).is_file() else next(PATCHES.glob(f"**/{name}")))
        row = next(ln for ln in table.splitlines() if f"/{name})" in ln)
        assert p.fields["subject"][0].replace("|", "\\|") in row and ", ".join(p.groups) in row


def test_lines_column_follows_the_series():
    rows = {r.name: r for r in patches_doc.rows()}
    for series in PATCHES.glob("series-*"):
        version = series.name.removeprefix("series-")
        for rel, _ in patches_doc.read_series(series):
            name = rel.rsplit("/", 1)[-1]
            assert version in [x.version for x in rows[name].listings], (name, version)
    table = patches_doc.table()
    seed = next(ln for ln in table.splitlines() if ln.startswith("| [0001]"))
    assert "0.32.0 (`upstream`)" in seed and "[PR #50073](https://github.com/vllm-project/vllm/pull/50073)" in seed


def test_a_new_patch_gets_its_row_and_makes_the_table_stale(tmp_path, capsys):
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    doc = tmp_path / "patches.md"
    doc.write_text(f"# Patches\n{patches_doc.BEGIN}\n{patches_doc.END}\n")
    assert patches_doc.main(["--doc", str(doc), "--patches", str(patches)]) == 0
    assert patches_doc.main(["--check", "--doc", str(doc), "--patches", str(patches)]) == 0
    (patches / "9999-example.patch").write_text(
        "Subject: an example\nGroup: mmcpu\nUpstream: none - an example.\n\n"
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    with open(patches / "series-0.32.0", "a") as f:
        f.write("# Ours: an example (Group: mmcpu):\n9999-example.patch\n")
    assert patches_doc.main(["--check", "--doc", str(doc), "--patches", str(patches)]) == 1
    assert "differs" in capsys.readouterr().err
    assert patches_doc.main(["--doc", str(doc), "--patches", str(patches)]) == 0
    row = next(ln for ln in doc.read_text().splitlines() if ln.startswith("| [9999]"))
    assert row == ("| [9999](../patches/9999-example.patch) | an example | mmcpu | 0.32.0 | none | an example |")


def test_a_patch_in_no_series_still_shows(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    (patches / "9998-forgotten.patch").write_text(
        "Subject: forgotten\nGroup: mmcpu\nUpstream: none\n\n--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    assert "| in no series |" in patches_doc.table(patches)


def test_no_markers_is_one_line_and_exit_1(tmp_path, capsys):
    doc = tmp_path / "patches.md"
    doc.write_text("# nothing here\n")
    assert patches_doc.main(["--check", "--doc", str(doc)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
