"""Layering: suite/config is the bottom (imports nothing else of suite) and suite/runtime.py sits
right above it (config only), so checks and probes never pull the engine into composition."""

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
