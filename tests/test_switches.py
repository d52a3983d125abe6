"""lit_qlora/base/switches.py: each LIT_QLORA_* variable has one strict parser, one home, and one row in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lit_qlora.base import switches
from lit_qlora.base.errors import InvalidInput
from lit_qlora.base.switches import SWITCHES

ROOT = Path(__file__).resolve().parents[1]


def test_a_flag_takes_1_or_0_and_refuses_anything_else_naming_the_variable():
    name = "LIT_QLORA_NF4_GEMV"
    assert switches.flag(name, {}) is None and switches.flag(name, {name: " "}) is None
    assert switches.flag(name, {name: "1"}) is True and switches.flag(name, {name: "0"}) is False
    for bad in ("true", "off", "yes", "2"):
        with pytest.raises(InvalidInput, match=f"{name}='{bad}': this switch takes 1 .on. or 0 .off.; unset, it is 1"):
            switches.flag(name, {name: bad})


def test_enabled_falls_back_to_the_listed_default(monkeypatch):
    monkeypatch.delenv("LIT_QLORA_NF4_GEMV", raising=False)
    monkeypatch.delenv("LIT_QLORA_NF4_FUSED", raising=False)
    assert switches.enabled("LIT_QLORA_NF4_GEMV") is True and switches.enabled("LIT_QLORA_NF4_FUSED") is False
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    monkeypatch.setenv("LIT_QLORA_NF4_FUSED", "1")
    assert switches.enabled("LIT_QLORA_NF4_GEMV") is False and switches.enabled("LIT_QLORA_NF4_FUSED") is True


def test_choices_are_checked_and_lists_keep_their_order():
    assert switches.choice("LIT_QLORA_NF4_BACKEND", {"LIT_QLORA_NF4_BACKEND": "EAGER"}) == "eager"
    assert switches.choice("LIT_QLORA_NF4_BACKEND", {}) is None
    with pytest.raises(InvalidInput, match="LIT_QLORA_NF4_BACKEND='native': this switch takes one of auto, eager"):
        switches.choice("LIT_QLORA_NF4_BACKEND", {"LIT_QLORA_NF4_BACKEND": "native"})
    env = {"LIT_QLORA_SDPA_BACKEND": "math, flash"}
    assert switches.choice_list("LIT_QLORA_SDPA_BACKEND", env) == ["math", "flash"]
    with pytest.raises(InvalidInput, match=r"\(not fast, slow\)"):
        switches.choice_list("LIT_QLORA_SDPA_BACKEND", {"LIT_QLORA_SDPA_BACKEND": "flash,fast,slow"})
    assert switches.text("LIT_QLORA_CFLAGS", {"LIT_QLORA_CFLAGS": " -g "}) == "-g"
    with pytest.raises(KeyError, match="LIT_QLORA_NOPE is not a lit-qlora switch"):
        switches.flag("LIT_QLORA_NOPE", {})


def test_in_effect_lists_what_is_set_hides_secrets_and_refuses_unknown_names():
    env = {"LIT_QLORA_NF4_GEMV": "0", "LIT_QLORA_API_KEY": "k3y", "LIT_QLORA_CFLAGS": "", "PATH": "/bin"}
    assert switches.in_effect(env) == {"LIT_QLORA_API_KEY": "set", "LIT_QLORA_NF4_GEMV": "0"}
    with pytest.raises(InvalidInput, match="LIT_QLORA_NF4_GEMM: no lit-qlora switch has this name"):
        switches.in_effect({"LIT_QLORA_NF4_GEMM": "0"})
    with pytest.raises(InvalidInput, match="LIT_QLORA_COMPILE_MODE='fast'"):
        switches.in_effect({"LIT_QLORA_COMPILE_MODE": "fast"})


def test_only_switches_py_reads_lit_qlora_variables_and_every_name_used_is_listed():
    """Issue 55 item 3's grep: no other module of the package reads a LIT_QLORA_* variable from the environment, and
    every LIT_QLORA_* name the code or the docs mention is a switch (or the C header guard)."""
    readers, names = [], set()
    for path in (ROOT / "lit_qlora").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"LIT_QLORA_[A-Z0-9_]+", text))
        if path.name != "switches.py":
            readers += [f"{path.name}: {line.strip()}" for line in text.splitlines()
                        if re.search(r"\benviron\b|getenv", line) and re.search(r"LIT_QLORA_|_ENV\b|\bENV\b", line)]
    assert readers == []
    for doc in [*(ROOT / "docs").glob("*.md"), *(ROOT / "tutorials").glob("*.md"), ROOT / "benchmarks/gpu/README.md"]:
        names |= set(re.findall(r"LIT_QLORA_[A-Z0-9_]*[A-Z0-9]", doc.read_text()))
    assert names - set(SWITCHES) == set()
    assert len(SWITCHES) == 16


def test_docs_switches_md_has_one_row_per_switch_with_its_default():
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(LIT_QLORA_\w+)` \| [^|]*(?:\\\|[^|]*)* \| ([^|]*) \|",
                                            (ROOT / "docs/switches.md").read_text(), re.M)}
    assert rows == {name: s.default for name, s in SWITCHES.items()}


def test_version_prints_the_switches_in_effect_and_a_bad_one_stops_a_command(monkeypatch, capsys):
    from lit_qlora.cli import main

    for name in [k for k in __import__("os").environ if k.startswith("LIT_QLORA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["LIT_QLORA_NF4_GEMV=0"]
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "no")
    with pytest.raises(SystemExit) as stop:
        main(["estimate", "--checkpoint_dir", "does-not-matter"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("litqlora: error: LIT_QLORA_NF4_GEMV='no': this switch takes 1 (on) or 0 (off)")
