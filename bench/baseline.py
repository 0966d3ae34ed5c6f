"""A/B against an earlier commit in the same benchmark run (`bench/throughput.py --baseline REV`).

The earlier commit is checked out into a temporary git worktree; its own `bench/throughput.py
--worker` builds and times its own suite step, so the row measures that commit's code exactly, while
the parent interleaves its timing windows with today's rows (same machine state, same random
tokens). The A/B line of the report is today's suite tokens/s over the baseline's, per shape.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path


def checkout(root: Path, rev: str) -> tuple[str, Path]:
    """(short commit, worktree path) of `rev`, removed again when this process exits."""
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = Path(tempfile.mkdtemp(prefix=f"bench-{commit}-")) / "tree"
    subprocess.run(
        ["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), commit],
        check=True,
    )

    def remove() -> None:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tree.parent, ignore_errors=True)

    atexit.register(remove)
    return commit, tree


def ab_lines(workers: dict, variant: str) -> list[str]:
    """'- A/B <shape> <precision>: suite x.xx of suite [@rev]' for every shape both rows finished."""
    lines = []
    for (shape, precision, contender, name), w in workers.items():
        if contender != "suite" or name != "":
            continue
        old = workers.get((shape, precision, "suite", variant))
        if w.windows and old is not None and old.windows:
            ratio = w.median("tokens_per_s") / old.median("tokens_per_s")
            lines.append(
                f"- A/B {shape} {precision}: suite {w.median('tokens_per_s'):,.0f} tokens/s, suite [{variant}] "
                f"{old.median('tokens_per_s'):,.0f} tokens/s: {ratio:.3f}x (ranges in the table)"
            )
    return lines
