"""scripts/installed.py: `make demo` and `make test` skip pip when nothing changed, and install when anything did."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_script():
    spec = importlib.util.spec_from_file_location("installed", ROOT / "scripts" / "installed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nothing_to_install_until_pyproject_changes_or_a_requirement_is_unmet(tmp_path, monkeypatch):
    installed = installed_script()
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # the stamps go to this "environment"
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text((ROOT / "pyproject.toml").read_text())
    never = installed.missing(pyproject, ("test",))
    assert never == ["pyproject.toml as it is now (pip last installed none here)"]  # a fresh environment installs
    (tmp_path / "lit-qlora-installed-test.txt").write_text(installed.stamp(pyproject))
    assert installed.missing(pyproject, ("test",)) == []  # this suite's environment has every requirement
    assert installed.missing(pyproject) == never  # the plain install has its own stamp

    text = pyproject.read_text()
    pyproject.write_text(text.replace('dependencies = [\n', 'dependencies = [\n    "torch>=99",\n    "no-such-dist-xyz",\n', 1))
    gaps = installed.missing(pyproject, ("test",))
    assert gaps[0] == "pyproject.toml as it is now (pip last installed another version here)"
    assert gaps[1].startswith("torch 2.") and gaps[1].endswith("(pyproject.toml wants >=99)")
    assert gaps[2:] == ["no-such-dist-xyz (not installed)"]
