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


def _module_of(path: Path) -> str:
    """suite/train/step.py -> suite.train.step; suite/models/__init__.py -> suite.models."""
    parts = path.relative_to(SUITE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_graph() -> dict[str, set[str]]:
    """module -> the suite modules its file imports (in-function imports included). `from suite.pkg
    import name` points at suite/pkg/name.py (or the package suite/pkg/name/) when there is one, else at
    the package suite.pkg. Importing a submodule also runs its package's __init__, but that implicit
    edge is left out: a package's __init__ importing its own submodules is not a cycle."""
    modules = {_module_of(path): path for path in SUITE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def test_no_import_cycle_between_files():
    """No two of suite's files import each other, directly or around a loop, even through an import
    inside a function: e.g. suite/parallel/pipeline.py importing `Placement` from
    suite/parallel/parallelize.py, which imports `build_pipeline` from pipeline.py (a shared type
    belongs in a module of its own, below both). Listed: each loop's files."""
    assert [" <-> ".join(component) for component in _cycles(_file_graph())] == []


def _deferral_said(lines: list[str], lineno: int, import_lines: set[int]) -> bool:
    """A `# deferred:` comment on the import's line, or in the comments right above it or above the
    block of imports it belongs to (one comment for `import pyarrow as pa` and
    `import pyarrow.parquet as pq`; blank lines between the block's sections are part of it)."""
    if "# deferred:" in lines[lineno - 1]:
        return True
    above = lineno - 1  # 1-based line number of the line above
    while above >= 1 and (
        above in import_lines or not lines[above - 1].strip() or lines[above - 1].lstrip().startswith("#")
    ):
        if lines[above - 1].lstrip().startswith("# deferred:"):
            return True
        above -= 1
    return False


def test_deferred_imports_say_why():
    """Imports sit at the top of their module. One inside a function is a deferral, and says why on
    its line or in the comment just above (`# deferred: transformers is optional here and costs ~2 s`):
    a bare `def f(): from suite.models import build_model` inside suite/ fails this test."""
    unsaid = []
    for path in sorted(SUITE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        functions = [
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        imports = {
            node
            for function in functions
            for node in ast.walk(function)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        import_lines = {n for node in imports for n in range(node.lineno, node.end_lineno + 1)}
        unsaid += [
            f"{path.relative_to(SUITE.parent)}:{n}: {lines[n - 1].strip()}"
            for n in sorted(node.lineno for node in imports)
            if not _deferral_said(lines, n, import_lines)
        ]
    assert unsaid == []
