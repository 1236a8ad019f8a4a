"""specdec/env.py: the SPECDEC_* variables read strictly (a bad value is a one-line error naming the
variable, never silently the default), a warning for a name specdec does not read, and the table
kept true to the code (every variable read is in it, every entry is read somewhere)."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest

from specdec import env
from specdec.cli import main
from specdec.errors import ConfigError

PACKAGE = pathlib.Path(env.__file__).parent


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("on", True), ("OFF", False), (" yes ", True),
                                      ("False", False), ("", None), (None, None)])
def test_switch_spellings(monkeypatch, raw, want):
    name = "SPECDEC_FUSED_LAYER"
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert env.switch(name) is (env.SWITCHES[name][0] if want is None else want)


@pytest.mark.parametrize("name", ["SPECDEC_FUSED_LAYER", "SPECDEC_MOE_GROUPED_BMM"])
def test_switch_bad_value_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "of")
    with pytest.raises(ConfigError, match=f"^{name}='of': want 1 or 0"):
        env.switch(name)


def test_integer_and_choice(monkeypatch):
    monkeypatch.setenv("SPECDEC_PREFILL_ROWS", "16")
    assert env.integer("SPECDEC_PREFILL_ROWS") == 16
    for bad in ("abc", "0", "513", "1.5"):
        monkeypatch.setenv("SPECDEC_PREFILL_ROWS", bad)
        with pytest.raises(ConfigError, match="SPECDEC_PREFILL_ROWS=.*1..512"):
            env.integer("SPECDEC_PREFILL_ROWS")
    monkeypatch.delenv("SPECDEC_PREFILL_ROWS")
    assert env.integer("SPECDEC_PREFILL_ROWS") == 128
    monkeypatch.setenv("SPECDEC_SPAN_ATTENTION", "SDPA")
    assert env.choice("SPECDEC_SPAN_ATTENTION") == "sdpa"
    monkeypatch.setenv("SPECDEC_SPAN_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="SPECDEC_SPAN_ATTENTION='flash': want one of split, sdpa"):
        env.choice("SPECDEC_SPAN_ATTENTION")


def test_check_warns_about_unknown_names_only(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONDNN", "0")  # a typo of SPECDEC_CPU_ONEDNN
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        env.check()
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and said[0].startswith("SPECDEC_CPU_ONDNN is set but specdec reads no such variable")


def test_cli_one_line_error_and_listing(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_ROW_EXACT", "maybe")
    assert main(["info", "--env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SPECDEC_ROW_EXACT='maybe'" in err
    monkeypatch.setenv("SPECDEC_ROW_EXACT", "off")
    assert main(["info", "--env"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in out]
    assert names == (sorted(env.SWITCHES) + sorted(env.INTEGERS) + sorted(env.CHOICES) + sorted(env.PROBABILITIES)
                     + sorted(env.OTHERS))
    assert [line.split()[1] for line in out if line.startswith("SPECDEC_ROW_EXACT ")] == ["off"]


def test_table_matches_the_code():
    """Every SPECDEC_* name the package reads is in a table, and every table entry is read somewhere
    (outside env.py): a switch added without its entry, or an entry left behind, fails here."""
    read: set[str] = set()
    for p in PACKAGE.rglob("*.py"):
        if p.name == "env.py":
            continue
        src = p.read_text(encoding="utf-8")
        read |= set(re.findall(r'env\.(?:switch|integer|choice|probability)\("(SPECDEC_[A-Z0-9_]+)"\)', src))
        read |= set(re.findall(r'environ(?:\.get)?[(\[]"(SPECDEC_[A-Z0-9_]+)"', src))
        assert not re.search(r'environ\.get\("SPECDEC_[A-Z0-9_]+", "[01]"\)', src), f"{p}: a switch read outside env.py"
    tests_only = {"SPECDEC_LLAMA_VOCAB_DIR", "SPECDEC_TRITON_DIR"}
    table = set(env.SWITCHES) | set(env.INTEGERS) | set(env.CHOICES) | set(env.PROBABILITIES) | set(env.OTHERS)
    assert read == table - tests_only
