"""Entry point of a launched worker: read the parent's frozen config and run the verb.

The elastic launcher starts `python -m suite.cli.worker <verb> <config.yaml>` once per rank, which
runs the verb's `in_rank` (suite.verb) there; with
`launch.worker_start=fork` that process hands the work to a warm process forked by
suite.launch.fork_server and stands for it (this module then imports nothing heavy first). Failures
are recorded in the launcher's per-rank error file (so the parent can name the rank and the cause
in one line); a ConfigError exits 2 without a traceback, anything else prints its traceback here,
on this rank's console, and exits 1. Workers end with os._exit once their output is flushed (see
`_exit`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path


def _record(exc: BaseException) -> None:
    """Write the elastic error file the parent reads (no-op outside the launcher)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    # deferred: this process may only stand for a forked worker (see __main__), and then imports nothing heavy
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    with contextlib.suppress(Exception):  # reporting must never mask the real failure
        ErrorHandler().record_exception(exc)


def run(verb_name: str, config_path: Path) -> int:
    """Run the verb's rank function (suite.verb.Verb.in_rank) on the config the parent froze."""
    # deferred: this process may only stand for a forked worker (see __main__), and then imports nothing heavy
    from suite.cli.verbs import VERBS
    from suite.config.compose import load_saved_config
    from suite.config.errors import ConfigError
    from suite.preflight import worker_dims

    verb = VERBS.get(verb_name)
    if verb is None or verb.in_rank is None:
        raise ConfigError(f"verb {verb_name!r} does not run under the launcher")
    resolved_yaml = config_path.read_text()
    with contextlib.suppress(OSError):  # the launcher stops saying that this node waits for its peers
        config_path.with_name("started").touch()
    cfg = load_saved_config(config_path)
    # this attempt's world: an elastic job (launch.nproc_per_node=min:max) may run below its maximum;
    # the parent checked everything else before it launched us
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    dims = worker_dims(cfg, world, verb.layout_checks)
    return verb.in_rank(cfg, dims, resolved_yaml)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m suite.cli.worker <verb> <config.yaml> (started by the suite launcher)",
            file=sys.stderr,
        )
        return 2
    # deferred: this process may only stand for a forked worker (see __main__), and then imports nothing heavy
    from suite.config.errors import ConfigError

    try:
        code = run(argv[0], Path(argv[1]))
        # deferred: this process may only stand for a forked worker (see __main__), and then imports nothing heavy
        from suite.parallel.env import destroy_process_group

        destroy_process_group()
        return code
    except ConfigError as exc:
        _record(exc)  # the parent prints it once, as one line
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            return exc.code or 0
        # a run that stops with a one-line message (non-finite steps, full disk): the parent prints it
        _record(exc)
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            print(exc.code, file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:
        traceback.print_exc()  # on this rank's console
        _record(exc)
        return 1


def _exit(code: int) -> None:
    """Leave without interpreter finalisation: gloo's worker threads may still hold async work
    whose tensors would need the GIL while Python tears down, which aborts the process (SIGABRT)
    after a run that succeeded. Everything the run writes is flushed and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from suite.launch.fork_server import SERVER_ENV, forward

    address = os.environ.get(SERVER_ENV)
    forwarded = forward("suite.cli.worker", sys.argv[1:], address) if address else None
    _exit(main(sys.argv[1:]) if forwarded is None else forwarded)
