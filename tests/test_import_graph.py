"""The package's import graph has no cycle.

Every module under ``atom/`` is parsed (never imported) and each ``import atom...`` or ``from
atom... import ...`` statement is an edge, wherever it stands: module level, inside a function
(lazy imports) or under ``TYPE_CHECKING``. A cycle means two modules each need the other, which
lazy imports only hide; the fix is a third module both can import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "atom"


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages as ``__init__``)."""
    names = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    """The package modules one import statement names (``from m import sub`` names m.sub when
    that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.append(sub)
        elif base in modules:
            found.append(base)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = {dep for node in ast.walk(tree) for dep in imported(node, package, modules)}
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "atom.model_engine.llm_engine" in graph["atom.llm"]
    # function-local: the runner creates the structured-output worker on first use
    assert "atom.structured_output.worker" in graph["atom.model_engine.model_runner"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
