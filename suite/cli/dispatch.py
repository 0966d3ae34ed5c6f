"""`suite <verb> [key=value ...] [group=option ...]`: a thin dispatcher in front of Hydra's compose API.

Each verb is a record in the registry (suite.verb), built by its own module in suite/cli/verbs/;
this module only parses the command line the same way for every verb and calls the verb's `run`,
which composes the recipe once in this (parent) process, validates it, and either runs here or
hands the frozen config to the elastic launcher when more than one process is asked for.
"""

from __future__ import annotations

import sys

from suite.cli.common import _expand
from suite.cli.help import usage, verb_help
from suite.cli.training import print_launch
from suite.cli.verbs import VERBS
from suite.config.errors import ConfigError
from suite.folders import OVERWRITE
from suite.verb import Verb, check_keys


def _split_flags(args: list[str]) -> tuple[list[str], set[str]]:
    flags = {a for a in args if a.startswith("--")}
    return [a for a in args if not a.startswith("--")], flags


def _take_valued_flags(verb: Verb, args: list[str]) -> list[str]:
    """`--explain LAYOUT` (suite plan), `--rank N` (suite pretrain --dry-run) as one `--flag=VALUE`
    argument; other arguments unchanged."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in verb.valued_flags:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{args[i]} needs a value, e.g. {verb.valued_flags[args[i]]}")
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def _unknown_flag(verb: Verb, flags: set[str]) -> str | None:
    known = {"--json", "--help", *verb.flags}
    unknown = sorted(f for f in flags - known if f.split("=", 1)[0] not in verb.valued_flags)
    if not unknown:
        return None
    extra = "".join(f", {v}" for v in verb.flags) + "".join(f", {v} VALUE" for v in verb.valued_flags)
    return (
        f"unknown flag {unknown[0]} for '{verb.name}'; flags are --help and --json{extra}, "
        "everything else is key=value"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    verb = VERBS.get(name)
    if verb is None:
        print(f"error: unknown verb '{name}'; use one of: {', '.join(VERBS)} (suite --help)", file=sys.stderr)
        return 2
    try:
        rest = _take_valued_flags(verb, rest)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    overrides, flags = _split_flags(rest)
    if flags & {"--help", "-h"} or "-h" in overrides:
        print(verb_help(verb))
        return 0
    problem = _unknown_flag(verb, flags)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        check_keys(verb, _expand(overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    if OVERWRITE in flags and verb.composes:
        overrides = [*overrides, "train.overwrite=true"]
    try:
        if "--print-launch" in flags:
            return print_launch(verb.name, overrides)
        return verb.run(overrides, flags)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code


if __name__ == "__main__":
    sys.exit(main())
