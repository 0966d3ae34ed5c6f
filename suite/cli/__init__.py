"""The command line: `suite <verb> ...` (dispatch.py: parsing the same way for every verb, then the
verb's record from the registry, suite/cli/verbs/), the rank entry `python -m suite.cli.worker`,
help, and what the verbs share (common.py, training.py).

This package's own import stays light: the process each launched rank starts
(`python -m suite.cli.worker`) imports it before it hands itself to the warm fork server, and must
not pay for the CLI's imports on every rank.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """`suite ...` (suite.cli.dispatch.main)."""
    # deferred: the package stays light for the rank entry (module docstring)
    from suite.cli.dispatch import main as dispatch

    return dispatch(argv)
