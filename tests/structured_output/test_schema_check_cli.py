"""`atom schema-check`: a line per file, exit 0 only when all pass, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")

from test_json_schema_suite import byte_tokenizer  # noqa: E402

from atom.structured_output import schema_check  # noqa: E402


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    deep = "[" * 3000 + "]" * 3000
    nested = '{"items":' * 3000 + "{}" + "}" * 3000
    contents = {
        "ok": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}),
        "bad_regex": json.dumps({"properties": {"a": {"pattern": "(?=x)"}}}),
        "not_json": "{nope",
        "deep_array": deep,
        "deep_schema": nested,
        "huge_pattern": json.dumps({"pattern": "a" * (4 << 20)}),
        "remote": json.dumps({"$ref": "http://localhost:1234/x.json"}),
        "binary": "\udcff",
    }
    out = {}
    for name, text in contents.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        out[name] = str(path)
    out["missing"] = str(tmp_path / "missing.json")
    return out


@pytest.fixture
def fast_tokenizer(monkeypatch) -> None:
    """The worker backend's strict compile, over a byte tokenizer instead of SmolLM2's."""
    from atom.structured_output.backend_guidance import (
        JSON_OPTIONS,
        GuidanceBackend,
        parser_limits,
    )

    backend = object.__new__(GuidanceBackend)
    backend.ll_tokenizer, backend.limits = byte_tokenizer(), parser_limits()
    backend.json_options = JSON_OPTIONS
    monkeypatch.setattr(schema_check, "_compiler", lambda spec: backend.grammar)


def test_json_lines(files: dict[str, str], fast_tokenizer, capsys) -> None:
    assert schema_check.run_schema_check(list(files.values()), as_json=True) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_name = {Path(r["file"]).stem: r for r in lines}
    assert set(by_name) == set(files)
    for r in lines:
        assert set(r) == {"file", "ok", "error", "pointer", "compile_ms"}
    assert by_name["ok"]["ok"] and by_name["ok"]["compile_ms"] >= 0
    assert by_name["bad_regex"]["pointer"] == "/properties/a/pattern"
    assert by_name["huge_pattern"]["pointer"] == "/pattern"
    assert by_name["remote"]["pointer"] == "/$ref"
    assert by_name["deep_schema"]["error"]
    for r in lines:
        assert r["ok"] == (Path(r["file"]).stem == "ok")
        assert r["ok"] or r["error"]


def test_exit_zero_when_all_ok(files: dict[str, str], fast_tokenizer, capsys) -> None:
    assert schema_check.run_schema_check([files["ok"]]) == 0
    assert "ok" in capsys.readouterr().out


def test_command_line_never_tracebacks(files: dict[str, str]) -> None:
    """The real command with its default tokenizer (the embedded SmolLM2)."""
    cmd = [sys.executable, "-m", "atom.cli", "schema-check", *files.values()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert len(done.stdout.splitlines()) == len(files)
    assert f"{files['ok']}: ok" in done.stdout
