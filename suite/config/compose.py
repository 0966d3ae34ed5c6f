"""Compose a recipe with Hydra's compose API (never @hydra.main) and turn its errors into one line.

Search order for config groups: $SUITE_RECIPES folders, then ./recipes, then the shipped recipes
(recipes/ at the repository root, installed as suite/recipes/),
so a user's own `recipe/my13b.yaml` (or `recipe=./my13b.yaml`) is found before ours.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig


def _shipped_recipes() -> Path:
    """suite/recipes/ in an installed wheel; the repository's recipes/ in a checkout (editable installs
    and PYTHONPATH runs), which setup.py ships as suite/recipes/."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


SHIPPED_RECIPES = _shipped_recipes()
ENTRY_DIR = SHIPPED_RECIPES / "_entry"
GROUP_NAMES = (
    "recipe",
    "model",
    "parallel",
    "recompute",
    "compress",
    "data",
    "optim",
    "sched",
    "log",
    "launch",
    "cluster",
)

ConfigStore.instance().store(name="suite_schema", node=SuiteConfig)


def recipe_search_dirs() -> list[Path]:
    """Folders searched for config groups, first match wins."""
    dirs: list[Path] = []
    for entry in os.environ.get("SUITE_RECIPES", "").split(os.pathsep):
        if entry and Path(entry).is_dir():
            dirs.append(Path(entry).resolve())
    local = Path.cwd() / "recipes"
    if local.is_dir() and local.resolve() != SHIPPED_RECIPES:
        dirs.append(local.resolve())
    dirs.append(SHIPPED_RECIPES)
    return dirs


def known_options(group: str, extra_dirs: list[Path] | None = None) -> list[str]:
    """Every option of a config group, across all search folders."""
    names: set[str] = set()
    for folder in (extra_dirs or []) + recipe_search_dirs():
        for path in (folder / group).glob("*.yaml"):
            names.add(path.stem)
    return sorted(names)


def _schema_field(key: str) -> tuple[bool, list[str]]:
    """Whether a dotted key exists in the schema, and the valid names at the level where it failed."""
    node: Any = SuiteConfig
    for part in key.split("."):
        if not (isinstance(node, type) and is_dataclass(node)):
            # Free-form below a dict/Any field (e.g. model.rope_scaling.factor) or list index.
            return True, []
        hints = get_type_hints(node)
        names = [f.name for f in fields(node)]
        if part not in names:
            return False, names
        node = hints[part]
        origin = get_origin(node)
        if origin is not None:  # Optional[X], list[X], dict[...]
            args = [a for a in get_args(node) if a is not type(None)]
            node = args[0] if origin is not list and len(args) == 1 else None
    return True, []


def _schema_type(key: str) -> str | None:
    """The declared type of a dotted key, for error messages ('int', 'Optional[float]', ...)."""
    node: Any = SuiteConfig
    hint: Any = None
    for part in key.split("."):
        if not (isinstance(node, type) and is_dataclass(node)):
            return None
        hint = get_type_hints(node).get(part)
        if hint is None:
            return None
        node = hint
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


OVERRIDES = OverridesParser.create()  # Hydra's own grammar, to read one override at a time


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(
            f"argument '{text}' is not an override; use key=value (e.g. train.max_steps=100) "
            "or group=option (e.g. recipe=gpt13b)"
        )
    key, value = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"argument '{text}' has an empty key; write key=value, e.g. train.max_steps=100")
    return key, value.strip()


def _check_syntax(key: str, value: str) -> None:
    """An override Hydra's grammar cannot read, or reads as a sweep (a comma), refused pointing at the
    value and how to quote it: single quotes for Hydra inside double quotes for the shell."""
    try:
        parsed = OVERRIDES.parse_override(f"{key}={value}")
    except HydraException as exc:
        why = str(exc).splitlines()[0]
    else:
        if not parsed.is_sweep_override():
            return
        why = "a comma makes it a list of runs (a sweep), which the suite does not run"
    if value.lstrip().startswith(("[", "{")):  # a list or mapping: complete it, quote it for the shell
        raise ConfigError(
            f"{key}={value}: the value cannot be read ({why}); write the list or mapping whole, in single "
            f"quotes for the shell, e.g. '{key}=[{{path: /data/a.jsonl, weight: 1}}]'"
        )
    quoted = value.replace("\\", "\\\\").replace("'", "\\'")
    raise ConfigError(
        f"{key}={value}: the value cannot be read ({why}); a value with spaces, commas, quotes, "
        f"brackets or '=' goes in single quotes inside double quotes: \"{key}='{quoted}'\""
    )


def _materialise_recipe_file(value: str, workdir: Path) -> str:
    """`recipe=./my.yaml`: expose the file as recipe/<stem>.yaml in a private search folder."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"recipe='{value}': no such file; give an existing .yaml path or one of: "
            + ", ".join(known_options("recipe"))
        )
    _check_recipe_text(value, path)
    target = workdir / "recipe"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target / path.name)
    return path.stem


def _check_recipe_text(value: str, path: Path) -> None:
    """A user's recipe file: valid YAML (the error names the file and line) with the package header."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"recipe='{value}' cannot be read ({exc}); give a readable UTF-8 .yaml file"
        ) from None
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # the construct that was left open (context) is where the mistake is, not where parsing gave up
        mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = "; ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
        raise ConfigError(
            f"recipe='{value}' is not valid YAML: {path.name}{where}: {what or str(exc).splitlines()[0]}; "
            "fix that line (`suite config cp recipe=gpt-tiny my.yaml` writes a valid example)"
        ) from None
    header = any(
        line.lstrip("#").split() == ["@package", "_global_"]
        for line in text.splitlines()
        if line.startswith("#")
    )
    if not header:
        raise ConfigError(
            f"recipe='{value}': {path} lacks the line '# @package _global_' that a recipe starts with "
            "(without it its keys land under recipe.*); add it as the first line"
        )


def _check_override(key: str, value: str, extra_dirs: list[Path]) -> None:
    if key in GROUP_NAMES:
        if value in ("null", "none") and key == "recipe":
            return
        options = known_options(key, extra_dirs)
        if value not in options:
            close = difflib.get_close_matches(value, options, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            typed = f"; pass {key}={close[0]}" if close else ""
            raise ConfigError(
                f"{key}='{value}' is not a known {key}{hint}; known: {', '.join(options)}{typed}"
            )
        return
    ok, names = _schema_field(key)
    if not ok:
        leaf = key.split(".")[-1]
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        close = difflib.get_close_matches(leaf, names, n=1)
        meant = f"{(parent + '.') if parent else ''}{close[0]}" if close else ""
        hint = f"did you mean '{meant}'? drop {key}= and pass {as_typed(meant, value)}" if close else ""
        valid = f"valid keys here: {', '.join(names)}"
        raise ConfigError(f"unknown key '{key}' (value '{value}'); {hint or valid}")


def as_typed(key: str, value: str) -> str:
    """`key=value` as a user types it in a shell: in single quotes inside double quotes when the value
    holds spaces, commas, quotes, brackets or '=' (what the override grammar and the shell need)."""
    if re.fullmatch(r"[^\s,'\"()\[\]{}=`;$<>|&*?]*", value):
        return f"{key}={value}"
    quoted = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"\"{key}='{quoted}'\""


def _explain(exc: BaseException) -> str:
    """Dig the OmegaConf cause out of a Hydra exception and make it one line."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        msg = str(getattr(cause, "msg", None) or cause or type(cause).__name__).splitlines()[0]
        expected = _schema_type(key)
        return f"{key}: {msg}" + (f"; use a value of type {expected}" if expected else "")
    return str(exc).splitlines()[0]


SHORTCUTS = {
    "prompt": "generate.prompt",
    "format": "export.format",
    "out": "export.out",
    "merge_lora": "export.merge_lora",
    "task": "eval.task",
    "metric": "eval.metric",
    "harness": "eval.harness",
}


def expand_shortcuts(overrides: list[str]) -> list[str]:
    """The short keys every verb takes (prompt=, out=, task= ...) as the config keys they stand for."""
    out = []
    for text in overrides:
        key, sep, value = text.partition("=")
        out.append(f"{SHORTCUTS.get(key, key)}{sep}{value}")
    return out


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose suite.yaml with the overrides; returns the interpolation-resolved DictConfig (its
    machine-dependent `auto` values are settled by suite.runtime.resolve_auto)."""
    overrides = list(overrides or [])
    workdir = Path(tempfile.mkdtemp(prefix="suite-recipe-"))
    try:
        extra_dirs: list[Path] = []
        final: list[str] = []
        recipe_name = None
        for text in overrides:
            key, value = _split_override(text)
            if key == "recipe" and (value.endswith((".yaml", ".yml")) or os.sep in value):
                value = _materialise_recipe_file(value, workdir)
                extra_dirs = [workdir]
            _check_override(key, value, extra_dirs)
            _check_syntax(key, value)
            if key == "recipe":
                recipe_name = value
            final.append(f"{key}={value}")
        if recipe_name and recipe_name not in ("null", "none"):
            final.append(f"recipe_name={recipe_name}")
        search = extra_dirs + recipe_search_dirs()
        final.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in search) + "]")
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(str(ENTRY_DIR), version_base="1.3"):
                cfg = compose("suite", overrides=final)
        except (HydraException, OmegaConfBaseException) as exc:  # multi-line messages; other errors are bugs
            raise ConfigError(_explain(exc)) from None
        try:
            OmegaConf.resolve(cfg)
        except OmegaConfBaseException as exc:
            message = _explain(exc)
            typed = [text for text in final if "${" in text]
            if message.startswith("?: ") and typed:  # an interpolation the user typed
                message = (
                    f"{typed[0]}: {message[3:]}; ${{...}} refers to another key (e.g. ${{model.name}}); "
                    "name an existing key or drop the ${...}"
                )
            raise ConfigError(message) from None
        return cfg
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        GlobalHydra.instance().clear()


def to_object(cfg: DictConfig) -> SuiteConfig:
    """Typed view of a composed config (attribute access with the schema's types)."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None


def load_saved_config(path: str | Path) -> SuiteConfig:
    """Re-read a run's resolved config.yaml against the schema."""
    schema = OmegaConf.structured(SuiteConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_explain(exc)}") from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
