"""The verb registry (suite.verb) is the one place that knows verbs by name.

`test_no_code_outside_the_registry_compares_a_verb_name` fails on the code this registry replaced:
`if verb == "finetune":` in the worker, `stage.verb in ("eval", "generate")` in the pipeline,
`{"finetune": ..., "distill": ...}` tables keyed by verb (the fork server's preload, the default
recipes, the pipeline's output keys). The other tests fail when a record is missing a part the
command line, the worker or `suite run` reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

from suite.cli import main
from suite.cli.verbs import VERBS
from suite.verb import STAGE_OUTPUTS

SUITE = Path(__file__).resolve().parents[2] / "suite"
REGISTRY = ("suite/verb.py", "suite/cli/verbs/")


def _names_verb(node: ast.AST) -> bool:
    """`verb`, `self.verb`, `stage.verb`, `rec["verb"]`, `verb_name`: an expression about a verb."""
    if isinstance(node, ast.Name):
        return "verb" in node.id
    if isinstance(node, ast.Attribute):
        return "verb" in node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return "verb" in str(node.slice.value)
    return False


def _literals(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def verb_name_branches(source: str, where: str) -> list[str]:
    """`where:line` of each comparison of a verb expression with a verb's name, and of each table
    keyed by two or more verb names."""
    names = set(VERBS)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_verb(s) for s in sides) and any(
                lit in names for s in sides if not _names_verb(s) for lit in _literals(s)
            ):
                found.append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len([k for k in keys if k in names]) >= 2 and set(keys) <= names:
                found.append(f"{where}:{node.lineno}")
    return found


def test_no_code_outside_the_registry_compares_a_verb_name():
    found = []
    for path in sorted(SUITE.rglob("*.py")):
        rel = str(path.relative_to(SUITE.parent))
        if not rel.startswith(REGISTRY):
            found += verb_name_branches(path.read_text(), rel)
    assert found == []


def test_the_scan_finds_the_branches_it_replaced():
    """The checks above could not fail if the scan missed these shapes (each was in the tree)."""
    old = """
if verb == "finetune":
    pass
worker_dims(cfg, world, finetune=verb == "finetune")
x = stage.verb in ("eval", "generate")
y = rec["verb"] in ("eval", "generate")
PRELOAD = {"finetune": ("a",), "distill": ("b",), "eval": ("c",)}
"""
    assert len(verb_name_branches(old, "old.py")) == 5


def test_every_verb_is_complete():
    """What the command line, the worker and `suite run` read from a record is there and coherent."""
    assert set(VERBS) >= {"pretrain", "finetune", "distill", "eval", "export", "quantize", "run"}
    for verb in VERBS.values():
        assert verb.summary and "\nExamples:\n" in verb.help, verb.name
        assert verb.stage_output in (None, *STAGE_OUTPUTS), verb.name
        if verb.stage_output in ("run", "checkpoint"):
            assert verb.output_key == "run.dir", verb.name
        if verb.run_identity is not None:  # a resumable run folder is a launched training verb's
            assert verb.in_rank is not None and verb.stage_output == "run", verb.name
        assert all(f.startswith("--") for f in (*verb.flags, *verb.valued_flags)), verb.name


def test_the_command_line_reads_the_registry(capsys):
    """A verb's flags come from its record: --dry-run is pretrain's, not finetune's."""
    assert main(["finetune", "--dry-run"]) == 2
    assert "unknown flag --dry-run for 'finetune'" in capsys.readouterr().err
    assert main(["plan", "--explain"]) == 2  # a valued flag without its value: the record's example
    assert "--explain dp4-tp8sp-pp12-mb1-full" in capsys.readouterr().err
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n  {name:10s} " in listed for name in VERBS)


def test_a_key_the_verb_does_not_read_is_refused_naming_what_it_reads(capsys):
    """A key that silently does nothing is refused: removing `check_keys` from main, or a verb
    record losing its `unused` sections, lets these run (and `ckpt=` on finetune train from the
    recipe's base instead of the model the user named)."""
    assert main(["finetune", "ckpt=runs/base"]) == 2
    err = capsys.readouterr().err
    assert "suite finetune does not read ckpt" in err and "model.init_from=runs/base" in err
    assert main(["pretrain", "generate.temperature=0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "suite generate" in err and "drop generate.temperature=" in err
    assert main(["quantize", "ckpt=runs/x", "optim.lr=0.1"]) == 2
    assert "suite quantize does not read optim" in capsys.readouterr().err
