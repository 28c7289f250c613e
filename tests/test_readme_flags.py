"""The README's vLLM-to-ATOM flag table names only flags that `atom serve --help` has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from atom.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def test_flag_table_matches_serve_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    flags = set(re.findall(r"(--[a-z0-9-]+)", capsys.readouterr().out))
    text = README.read_text()
    table = text[text.index("| vLLM `vllm serve` | `atom serve` |") :].split("\n\n")[0]
    rows = [line.split("|")[2] for line in table.splitlines()[2:]]
    named = {flag for cell in rows for flag in re.findall(r"`(--[a-z0-9-]+)", cell)}
    assert len(rows) > 15 and named
    assert named <= flags, named - flags
