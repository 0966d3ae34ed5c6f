"""The embedded default corpus: English prose that every machine with the suite already has.

Docstrings of the Python standard library, then of the suite's installed dependencies, parsed
with `ast` (never imported, so nothing runs) in sorted file order. No network, and the same bytes
on every build on a given machine, so `suite pretrain` works out of the box and reproducibly.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

CORPUS_FILE = "corpus.jsonl"
MIN_DOCSTRING_CHARS = 40
# Folders that hold tests, GUI code or other interpreters' packages rather than documented APIs.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
# The suite's own dependencies first: they exist wherever the suite is installed.
DEPENDENCIES = (
    "datasets",
    "hydra",
    "numpy",
    "omegaconf",
    "pyarrow",
    "rich",
    "safetensors",
    "tokenizers",
    "torch",
    "transformers",
    "wandb",
)
_DOC_NODES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _python_files(root: Path) -> Iterator[Path]:
    """Every .py file under root in a stable (sorted, depth-first) order, skipping test folders."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                yield Path(folder) / name


def _docstrings(tree: ast.AST) -> Iterator[str]:
    """Module, class and function docstrings in source order (ast.walk would go breadth-first)."""
    doc = ast.get_docstring(tree, clean=False) if isinstance(tree, (ast.Module, *_DOC_NODES)) else None
    if doc:
        yield inspect.cleandoc(doc)
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (*_DOC_NODES, ast.If, ast.Try)):
            yield from _docstrings(child)


def file_document(path: Path, seen: set[bytes]) -> str:
    """One document per source file: its long, not-yet-seen docstrings separated by blank lines."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes etc. in third-party files
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError, RecursionError):
        return ""
    parts = []
    for doc in _docstrings(tree):
        doc = doc.encode("utf-8", "replace").decode("utf-8")  # lone surrogates would break JSON
        if len(doc) < MIN_DOCSTRING_CHARS:
            continue
        digest = hashlib.blake2b(doc.encode(), digest_size=16).digest()
        if digest in seen:  # transformers copies the same docstring into many models
            continue
        seen.add(digest)
        parts.append(doc)
    return "\n\n".join(parts)


def _package_roots() -> list[Path]:
    """Standard library first, then each dependency's folder (found without importing it)."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for name in DEPENDENCIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(Path(location))
    return roots


def _site_package_roots(already: list[Path]) -> list[Path]:
    """The remaining top-level packages of site-packages, sorted, for caps beyond the dependencies."""
    paths = sysconfig.get_paths()
    sites = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    done = {p.resolve() for p in already}
    roots = []
    for site in sites:
        if not site.is_dir():
            continue
        for child in sorted(site.iterdir()):
            if child.is_dir() and child.resolve() not in done and (child / "__init__.py").is_file():
                roots.append(child)
    return roots


def iter_documents() -> Iterator[str]:
    """All embedded-corpus documents in their fixed order (lazily, so a small cap parses little)."""
    seen: set[bytes] = set()
    roots = _package_roots()
    for root in roots:
        for path in _python_files(root):
            text = file_document(path, seen)
            if text:
                yield text
    for root in _site_package_roots(roots):
        for path in _python_files(root):
            text = file_document(path, seen)
            if text:
                yield text


def build_embedded_corpus(out_dir: Path, max_mb: float) -> Path:
    """Write `out_dir/corpus.jsonl` ({"text": ...} per line) holding up to `max_mb` MB of UTF-8 text.

    Reuses an existing complete corpus file; writes to a temporary name first so an interrupted
    build never leaves a truncated corpus behind.
    """
    out_dir = Path(out_dir)
    target = out_dir / CORPUS_FILE
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = int(max_mb * 1_000_000)
    tmp = out_dir / f".{CORPUS_FILE}.tmp-{os.getpid()}"
    total = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for text in iter_documents():
                size = len(text.encode("utf-8"))
                if total + size > budget:
                    break
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                total += size
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def read_corpus(path: Path) -> list[str]:
    """The documents of a corpus.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]
