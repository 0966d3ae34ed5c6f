"""Repository-wide safety properties: no unpickling of untrusted files, no secrets in logged configs."""

from __future__ import annotations

import ast
from pathlib import Path

from suite.train.loggers import scrub_secrets

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("suite", "bench", "scripts") for p in (REPO / folder).rglob("*.py"))


def _calls(tree: ast.AST, dotted: str):
    module, attr = dotted.rsplit(".", 1)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
            value = node.func.value
            if isinstance(value, ast.Name) and value.id == module:
                yield node


def test_torch_load_always_uses_weights_only():
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in _calls(tree, "torch.load"):
            flags = {kw.arg: kw.value for kw in call.keywords}
            ok = isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True
            if not ok:
                offenders.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert not offenders, f"torch.load without weights_only=True at {offenders}"
    assert SOURCES, "no sources scanned"


def test_no_pickle_or_remote_code():
    offenders = []
    for path in SOURCES:
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        for node in ast.walk(tree):
            remote = isinstance(node, ast.keyword) and node.arg == "trust_remote_code"
            if remote and not (isinstance(node.value, ast.Constant) and node.value.value is False):
                offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno} trust_remote_code")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n in ("pickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports pickle")
    assert not offenders, offenders


def test_secret_looking_values_are_scrubbed():
    config = {"log": {"wandb_api_key": "abc123", "wandb_project": "suite"}, "hf_token": "hf_x", "lr": 1e-3}
    clean = scrub_secrets(config)
    assert clean["log"]["wandb_api_key"] == "***" and clean["hf_token"] == "***"
    assert clean["log"]["wandb_project"] == "suite" and clean["lr"] == 1e-3
