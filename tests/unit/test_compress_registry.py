"""Compression methods are registered objects (suite.models.compression): nothing outside the registry
decides anything by comparing a method's name.

test_no_method_name_is_compared_outside_the_registry fails, naming file:line, on code such as

    if cfg.compress.method == "gptq": ...               # a comparison with a method's name
    if method in ("int4", "gptq"): ...                  # membership in a literal list of names
    if c.method.startswith("qat-"): ...                 # a prefix of method names
    EXPORTABLE = ("int8", "w8a8", "int4")               # a list of names to keep in step
    UNCALIBRATED = {"gptq": "int4"}                     # names as a dict's keys

anywhere in suite/ but the registry module: what such code decides belongs on the method's class.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "suite"
REGISTRY = {"suite/models/compression.py"}  # where the names are declared, once each
# literals that equal a method's name but name something else (file -> why)
OTHER_NAMESPACES = {
    "suite/export/programs.py": "export.quantize: onnxruntime's int8/int4 quantizers for format=onnx",
}
# comparisons outside this session's files, replaced by the owners of those files (a line each in the
# compression branch's report); delete an entry once its file uses the registry
PENDING: dict[str, str] = {}


def _names() -> set[str]:
    from suite.models.compression import all_names

    return set(all_names())


def _strings(node: ast.AST) -> list[str]:
    """The string constants `node` is, or holds as a tuple/list/set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def method_name_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each comparison of, prefix test on, or literal collection of method names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
        ):
            hits = [s for side in [node.left, *node.comparators] for s in _strings(side) if s in names]
            if hits:
                found.append((node.lineno, f"compares with {hits[0]!r}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith", "removeprefix")
        ):
            hits = [
                s for arg in node.args for s in _strings(arg) if s and any(n.startswith(s) for n in names)
            ]
            if hits:
                found.append((node.lineno, f"{node.func.attr}({hits[0]!r})"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hits = [s for s in _strings(node) if s in names]
            if len(hits) >= 2:
                found.append((node.lineno, f"lists {hits}"))
        elif isinstance(node, ast.Dict):
            hits = [s for key in node.keys if key is not None for s in _strings(key) if s in names]
            if hits:
                found.append((node.lineno, f"keys a dict by {hits}"))
    return found


def test_no_method_name_is_compared_outside_the_registry():
    names = _names()
    found, excused = [], set()
    for path in sorted(SUITE.rglob("*.py")):
        rel = path.relative_to(SUITE.parent).as_posix()
        uses = method_name_uses(path.read_text(), names)
        if rel in REGISTRY or rel in OTHER_NAMESPACES or rel in PENDING:
            excused.update([rel] if uses else [])
            continue
        found += [f"{rel}:{line}: {what}" for line, what in uses]
    stale = sorted((set(OTHER_NAMESPACES) | set(PENDING)) - excused)
    assert stale == [], f"these files compare no method name any more: drop their entries here: {stale}"
    assert found == [], (
        "decide on the method's class (suite.models.compression), not its name:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "code",
    [
        'if cfg.compress.method == "gptq":\n    pass',
        'ok = method not in ("int4", "gptq")',
        'qat = c.method.startswith("qat-")',
        'EXPORTABLE = ("int8", "w8a8", "int4")',
        'UNCALIBRATED = {"gptq": "int4"}',
    ],
)
def test_the_scan_finds_the_wrong_code_its_docstring_names(code):
    assert method_name_uses(code, _names())


def test_the_scan_leaves_other_strings_alone():
    code = 'if cfg.recompute.granularity == "none" and fmt in ("hf", "gguf"):\n    s = "compress=int8"'
    assert method_name_uses(code, _names()) == []


def test_every_method_answers_what_the_verbs_ask():
    """Each registered method says what it needs and where it goes, with its own config dataclass."""
    from dataclasses import fields, is_dataclass

    from suite.config.schema import CompressConfig
    from suite.models.compression import for_training, get, names, training_names

    flat = {f.name for f in fields(CompressConfig)}
    assert names()[:3] == ["int8", "w8a8", "int4"]
    for name in names():
        method = get(name)
        assert method.name == name and method.summary and method.devices
        assert is_dataclass(method.options) and {f.name for f in fields(method.options)} <= flat
        assert isinstance(method.settings(CompressConfig(method=name)), method.options)
    for name in training_names():
        trained = for_training(name)
        assert trained is not None and trained.training_name == name
        assert trained.grid(CompressConfig(method=name)) is not None  # where learned scales are stored
