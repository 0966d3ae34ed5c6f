"""Layering: no import cycle between suite's packages; suite/config is the bottom (imports nothing
else of suite) and suite/runtime.py sits right above it (config only), so checks and probes never
pull the engine into composition."""

from __future__ import annotations

import ast
from pathlib import Path

SUITE = Path(__file__).resolve().parents[2] / "suite"


def _suite_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute `suite.*` import in a file, at any depth (lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            found.append((node.lineno, node.module or ""))
    return [(line, name) for line, name in found if name == "suite" or name.startswith("suite.")]


def test_config_imports_nothing_else_of_suite():
    files = sorted((SUITE / "config").glob("*.py"))
    assert files
    upward = [
        f"{path.name}:{line} imports {name}"
        for path in files
        for line, name in _suite_imports(path)
        if not name.startswith("suite.config")
    ]
    assert upward == []


def test_runtime_imports_only_config():
    upward = [
        f"runtime.py:{line} imports {name}"
        for line, name in _suite_imports(SUITE / "runtime.py")
        if not name.startswith("suite.config")
    ]
    assert upward == []


def _package(module: str) -> str:
    """`suite.train.step` -> `train`; a top-level module (`suite.cli`) is its own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "suite"


def test_no_import_cycle_between_packages():
    """Imports point down (cli -> verbs -> train -> parallel -> data/models -> config): a cycle
    between suite's packages (lazy imports included) is a layering bug."""
    graph: dict[str, set[str]] = {}
    for path in SUITE.rglob("*.py"):
        rel = path.relative_to(SUITE.parent).with_suffix("")
        here = _package(".".join(rel.parts))
        for _, name in _suite_imports(path):
            there = _package(name)
            if there != here and name != "suite":
                graph.setdefault(here, set()).add(there)
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in trail:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif len(trail) < len(graph) + 1:
                visit(nxt, [*trail, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert cycles == []
