"""Functions stay short enough to read at once: none in `atom/` is over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ATOM = Path(__file__).resolve().parents[1] / "atom"
MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines() -> None:
    long = []
    for path in sorted(ATOM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ATOM.parent)}:{node.lineno} {node.name}")
    assert not long, long
