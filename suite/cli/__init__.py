"""The command line: `suite <verb> ...` (dispatch.py: parsing the same way for every verb, then the
verb's record from the registry, suite/cli/verbs/), the rank entry `python -m suite.cli.worker`,
help, and what the verbs share (common.py, training.py).

This package's own import stays light: the process each launched rank starts
(`python -m suite.cli.worker`) imports it before it hands itself to the warm fork server, and must
not pay for the CLI's imports on every rank.
"""

from __future__ import annotations

import os
import sys

BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def main(argv: list[str] | None = None) -> int:
    """`suite ...` (suite.cli.dispatch.main)."""
    # numpy's OpenBLAS starts a thread pool when imported, unless told one thread. The CLI does no BLAS
    # work of its own, and a process without threads can fork its ranks' server in place
    # (suite/launch/fork_server.py), which saves every launch the server's imports. OpenBLAS reads the
    # variable once, at import: the environment is restored after, so the ranks get the user's.
    pinned = "numpy" not in sys.modules and BLAS_THREADS not in os.environ
    if pinned:
        os.environ[BLAS_THREADS] = "1"
    try:
        # deferred: numpy under the pin, then the CLI; the package stays light for the rank entry
        import numpy  # noqa: F401

        from suite.cli.dispatch import main as dispatch
    finally:
        if pinned:
            os.environ.pop(BLAS_THREADS, None)
    return dispatch(argv)
