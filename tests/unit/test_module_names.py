"""A module's name says which one it is: no two modules in suite/ share a file name, except the
names that mean the same role in every package that has one.

It fails on the pairs this rule replaced (suite/outputs.py beside suite/pipeline/outputs.py,
suite/sources.py beside suite/data/sources.py, two report.py, two step.py ...) and on any new one.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SUITE = Path(__file__).resolve().parents[2] / "suite"
# one role, one name, wherever it occurs: a package's own config checks (checks.py), a model family's
# weight and config mapping (suite/models/<family>/convert.py), a training method's composition
# (method.py: compose(cfg) -> Method), and each verb's module, named after its verb (suite/cli/verbs/)
ROLES = {"__init__.py", "checks.py", "convert.py", "method.py"}


def shared_names(paths: list[Path]) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        rel = path.relative_to(SUITE.parent)
        if path.name in ROLES or rel.parts[:3] == ("suite", "cli", "verbs"):
            continue
        seen[path.name].append(str(rel))
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_modules_share_a_name():
    assert shared_names(sorted(SUITE.rglob("*.py"))) == {}


def test_the_rule_sees_the_old_pairs():
    old = [
        SUITE / "outputs.py",
        SUITE / "pipeline" / "outputs.py",
        SUITE / "data" / "checks.py",
        SUITE / "checks.py",
    ]
    assert shared_names(old) == {"outputs.py": ["suite/outputs.py", "suite/pipeline/outputs.py"]}
