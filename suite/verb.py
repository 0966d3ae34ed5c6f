"""The verb registry: what `suite <verb>` is, in one record per verb.

A verb is one module in suite/cli/verbs/ that builds a `Verb` and registers it; the registry line
in suite/cli/verbs/__init__.py imports it. Everything that used to switch on a verb's name reads
the record instead: the command line (flags, help, the default recipe), the launched worker (the
function each rank runs, the layout checks of an elastic attempt), run folders (the keys a
resumable run must share) and `suite run` (how a stage's output is found, checked and reported).

The registry sits this low (it imports only suite.config) because suite/pipeline, below the command
line, reads it too; the records are filled in by suite.cli.verbs, which every entry point (the CLI's
`main`, the rank entry `suite.cli.worker`) imports first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError

# what a pipeline stage of the verb leaves behind (suite.pipeline.outputs):
#   run         a resumable training run folder (checkpoints, summary.json); rerun: moved aside
#   checkpoint  a model folder written in one go (quantize, prune), with a before/after report
#   files       files fingerprinted one by one (export, prepare)
#   result      no folder of its own: its --json result, about the stage it measures (eval, generate)
STAGE_OUTPUTS = ("run", "checkpoint", "files", "result")
SECTIONS = ("train", "compress", "use", "tools")  # how `suite --help` groups the verbs


def deferred(target: str) -> Callable[..., Any]:
    """`module:function`, imported at the first call: a verb record names its engine's checks without
    importing the engine (the command line imports every verb module to list them)."""
    module, name = target.split(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = name
    return call


@dataclass(frozen=True)
class RunIdentity:
    """What a training verb's run folder must share with the command that resumes it, beyond the
    model architecture, optimizer and tokenizer every run records (suite.train.run_folder)."""

    keys: Callable[[Any], dict[str, Any]] = lambda cfg: {}
    # the models the run starts from or learns from, {dotted key: value as typed}
    sources: Callable[[Any], dict[str, Any]] = lambda cfg: {"model.init_from": cfg.model.init_from}
    # the tokenizer it trains with: the prepared data's, unless the verb's base model brings its own
    tokenizer: Callable[[Any, Path | None], Path | None] = lambda cfg, data_dir: (
        None if data_dir is None else Path(data_dir) / "tokenizer.json"
    )


@dataclass(frozen=True)
class Verb:
    name: str
    summary: str  # its line in `suite --help`
    help: str  # `suite <verb> --help` with examples ({recipes}, {clusters}, {pipelines} filled in)
    run: Callable[[list[str], set[str]], int]  # in the parent: (overrides, flags) -> exit code
    section: str = "use"  # where `suite --help` lists it (SECTIONS)
    flags: tuple[str, ...] = ()  # boolean flags besides --help and --json
    valued_flags: Mapping[str, str] = field(default_factory=dict)  # `--flag VALUE` -> an example
    default_recipe: str | None = None  # composed first unless recipe= is given
    composes: bool = False  # reads a composed config: --overwrite arrives as train.overwrite=true
    # config sections the verb never reads: typing one of their keys is refused in one line (a key that
    # silently does nothing is a mistake the user cannot see); `hints`: what to type instead, by key
    unused: tuple[str, ...] = ()
    hints: Mapping[str, str] = field(default_factory=dict)
    # launched ranks: the function each rank runs (suite.cli.worker), the layout checks an elastic
    # attempt on fewer processes repeats, what the fork server imports before forking a rank
    in_rank: Callable[[Any, Any, str], int] | None = None
    layout_checks: tuple[Callable[[Any, Any], None], ...] = ()
    rank_imports: tuple[str, ...] = ()
    run_identity: RunIdentity | None = None  # a training verb's resumable run folder
    stage_output: str | None = None  # in `suite run`: one of STAGE_OUTPUTS; None: not a stage
    output_key: str | None = None  # the key that names its output folder, which `suite run` sets

    @property
    def launches(self) -> bool:
        return self.in_rank is not None


VERBS: dict[str, Verb] = {}


def register(verb: Verb) -> Verb:
    if verb.name in VERBS:
        raise ValueError(f"verb {verb.name!r} is registered twice")
    if verb.section not in SECTIONS:
        raise ValueError(f"verb {verb.name!r}: section {verb.section!r} is not one of {SECTIONS}")
    if verb.stage_output not in (None, *STAGE_OUTPUTS):
        raise ValueError(
            f"verb {verb.name!r}: stage_output {verb.stage_output!r} is not one of {STAGE_OUTPUTS}"
        )
    VERBS[verb.name] = verb
    return verb


def get(name: str) -> Verb:
    try:
        return VERBS[name]
    except KeyError:
        raise ConfigError(f"verb '{name}' is unknown; use one of: {', '.join(VERBS)}") from None


def check_keys(verb: Verb, overrides: list[str]) -> None:
    """Refuse a typed key of a section `verb` does not read, naming the verbs that do read it."""
    for text in overrides:
        key, _, value = text.partition("=")
        key = key.lstrip("+~")
        section = key.split(".", 1)[0]
        if section not in verb.unused:
            continue
        hint = verb.hints.get(key)
        readers = [v.name for v in VERBS.values() if v.unused and section not in v.unused]
        read_by = f" (read by suite {', suite '.join(readers)})" if readers else ""
        fix = hint.format(value=value) if hint else f"drop {key}="
        raise ConfigError(f"{key}={value}: suite {verb.name} does not read {section}{read_by}; {fix}")


def stage_verbs() -> list[str]:
    """The verbs `suite run` can run as a stage."""
    return [name for name, verb in VERBS.items() if verb.stage_output is not None]
