"""Settings are written once (mmcpu/config.py): docs/settings.md's table is generated from the class and must be
current.
(compose.yaml's environment list against the same class: tests/test_compose.py.)"""

from __future__ import annotations

import re

from mmcpu.config import Settings
from mmcpu_dev import settings_doc


def test_docs_settings_table_is_generated_from_the_settings_class():
    assert settings_doc.main(["--check"]) == 0, "docs/settings.md is stale: run `make settings-doc`"


def test_the_table_lists_every_setting_once_with_its_env_name():
    names = re.findall(r"^\| `(MMCPU_\w+)` \|", settings_doc.table(), flags=re.M)
    assert names == [f"MMCPU_{name.upper()}" for name in Settings.model_fields]


def test_check_fails_on_a_stale_table(tmp_path, capsys):
    doc = tmp_path / "settings.md"
    text = settings_doc.DOC.read_text()
    doc.write_text(text.replace("| `MMCPU_RUNNER` |", "| `MMCPU_RUNNER_OLD` |"))
    assert settings_doc.main(["--check", "--doc", str(doc)]) == 1
    assert "differs" in capsys.readouterr().err
    assert settings_doc.main(["--doc", str(doc)]) == 0 and doc.read_text() == text  # regenerated


def test_no_markers_is_one_line_and_exit_1(tmp_path, capsys):
    doc = tmp_path / "settings.md"
    doc.write_text("# nothing here\n")
    assert settings_doc.main(["--check", "--doc", str(doc)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
