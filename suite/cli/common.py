"""What every verb shares: the short keys, composing the config once, reporting the result."""

from __future__ import annotations

import json
import sys

from suite.config.compose import compose_config, expand_shortcuts, to_object
from suite.config.errors import ConfigError

_expand = expand_shortcuts  # the verbs' name for it


def _compose(overrides: list[str], machine: bool = True):
    """(the composed config, its typed object). `machine`: settle the `auto` values that depend on the
    machine (suite.runtime: imports torch, seconds); a verb that runs no model (prepare) passes False."""
    raw = compose_config(_expand(overrides))
    if machine:
        from suite.runtime import resolve_auto  # deferred: torch

        resolve_auto(raw)
    return raw, to_object(raw)


def _say(text: str) -> None:
    """A note for the user on stderr (stdout holds the verb's result, one JSON line with --json)."""
    print(text, file=sys.stderr, flush=True)


def _compose_with_ckpt(overrides: list[str], example: str):
    """The config of a verb that reads a checkpoint (eval, generate, export): ckpt= is required.
    Returns (config, the verified model source); the verb says which step it read once it has
    succeeded (`_report`), so that a failure stays one line."""
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError(
            f"ckpt is missing; pass ckpt=<run.dir> (or a checkpoint folder), e.g. ckpt={example}"
        )
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.model_source import ModelSource

    return cfg, ModelSource.parse(cfg.ckpt, "ckpt")


def _report(flags: set[str], result: dict, text: str, source=None) -> int:
    """The verb's result: one JSON line with --json, else the human-readable text; first, on stderr,
    which checkpoint `source` (a ModelSource) was read, and at which step."""
    if source is not None:
        _say(source.describe())
    print(json.dumps(result) if "--json" in flags else text)
    return 0


def _report_compression(report: dict, what: str, flags: set[str]) -> int:
    """A compression verb's result: its before/after table, where it wrote, the report file."""
    text = f"{report['table']}\n{what} checkpoint: {report['checkpoint']}\nreport: {report['report']}"
    return _report(flags, {k: v for k, v in report.items() if k != "table"}, text)


def _explicit_dir(overrides: list[str]) -> bool:
    """run.dir typed on the command line (else the verb names its output folder after its input)."""
    return any(o.split("=", 1)[0] == "run.dir" for o in overrides)


def _device(device: str) -> str:
    import torch  # deferred: seconds to import, and `suite prepare` never needs it

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
