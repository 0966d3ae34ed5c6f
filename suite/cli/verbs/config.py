"""`suite config show|list|cp`: the resolved config, the recipes and options, a recipe copied for editing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from suite.cli.common import _expand
from suite.config.compose import GROUP_NAMES, compose_config, known_options, recipe_search_dirs
from suite.config.errors import ConfigError
from suite.output_paths import check_new_file
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    if not overrides:
        raise ConfigError("config needs a subcommand: show, list or cp (see `suite config --help`)")
    sub, rest = overrides[0], overrides[1:]
    if sub == "show":
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.runtime import resolve_auto

        raw = resolve_auto(compose_config(_expand(rest)))
        if "--json" in flags:
            print(json.dumps(OmegaConf.to_container(raw), indent=1))
        else:
            print(OmegaConf.to_yaml(raw), end="")
        return 0
    if sub == "list":
        if rest:
            raise ConfigError(f"config list takes no arguments (got '{rest[0]}'); use config show {rest[0]}")
        table = {group: known_options(group) for group in (*GROUP_NAMES, "pipeline")}
        if "--json" in flags:
            print(json.dumps(table, indent=1))
        else:
            for group, options in table.items():
                print(f"{group + ':':11s} {', '.join(options)}")
        return 0
    if sub == "cp":
        names = [a.split("=", 1)[1] for a in rest if a.startswith("recipe=")]
        dests = [a for a in rest if "=" not in a]
        if len(names) != 1 or len(dests) != 1:
            raise ConfigError(
                "config cp needs recipe=NAME and a destination, e.g. suite config cp recipe=gpt13b ./my13b.yaml"
            )
        options = known_options("recipe")
        if names[0] not in options:
            raise ConfigError(f"recipe='{names[0]}' is not a known recipe; known: {', '.join(options)}")
        source = next(
            d / "recipe" / f"{names[0]}.yaml"
            for d in recipe_search_dirs()
            if (d / "recipe" / f"{names[0]}.yaml").is_file()
        )
        dest = Path(dests[0])
        if dest.is_dir():
            dest = dest / source.name
        free = next(
            dest.with_name(f"{dest.stem}-{n}{dest.suffix}")
            for n in range(1, 10_000)
            if not dest.with_name(f"{dest.stem}-{n}{dest.suffix}").exists()
        )
        check_new_file(
            "config cp destination",
            str(dest),
            f"`suite config cp recipe={names[0]} {free}` (your edits stay untouched)",
        )
        shutil.copyfile(source, dest)
        print(f"copied {source.name} to {dest}; run it with: suite pretrain recipe={dest}")
        return 0
    raise ConfigError(f"config subcommand '{sub}' is unknown; use show, list or cp")


HELP = """usage: suite config show [overrides...] [--json]   print the resolved config
       suite config list                         list recipes and every config-group option
       suite config cp recipe=NAME DEST.yaml     copy a shipped recipe for editing, then:
                                                 suite pretrain recipe=DEST.yaml

Examples:
  suite config list
  suite config show recipe=llama-tiny
  suite config cp recipe=gpt-tiny ./mytiny.yaml
  suite pretrain recipe=./mytiny.yaml train.max_steps=20"""


VERB = register(
    Verb(
        name="config",
        summary="show / list / cp recipes: suite config show recipe=gpt13b",
        help=HELP,
        run=run,
        section="tools",
    )
)
