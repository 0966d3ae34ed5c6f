"""`suite align`'s methods, by name: preference tuning (dpo, simpo: suite.align.preference) and
reinforcement learning with rewards (grpo: suite.align.grpo).

A method is a module that registers `compose(cfg) -> suite.train.components.Method` under its name
with `@register("name")`, and its module on the METHOD_MODULES line below. The verb
(suite/cli/verbs/align.py) looks align.method up with `method(name)`, which refuses an unknown name in
one line listing the registered ones; nothing else names a method.

The method modules import the engine (torch, the trainer's components), so they are imported on the
first lookup, not with this package: the command line imports it to check align.method.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from suite.config.errors import ConfigError

# the registry line: importing a method module registers its methods
METHOD_MODULES = (
    "suite.align.preference",  # dpo, simpo
    "suite.align.grpo",  # grpo
)

Compose = Callable[[Any], Any]  # (SuiteConfig) -> suite.train.components.Method
Check = Callable[[Any], None]  # (SuiteConfig) -> None; raises ConfigError (run once, in the parent)
METHODS: dict[str, Compose] = {}
CHECKS: dict[str, Check] = {}
Identity = Callable[[Any], dict]  # (SuiteConfig) -> the settings a resumed run must keep
IDENTITIES: dict[str, Identity] = {}
LayoutCheck = Callable[[Any, Any], None]  # (SuiteConfig, ParallelDims); the base model's keys are known
LAYOUT_CHECKS: dict[str, LayoutCheck] = {}


def register(
    name: str,
    check: Check | None = None,
    identity: Identity | None = None,
    layout_check: LayoutCheck | None = None,
) -> Callable[[Compose], Compose]:
    """Register `compose(cfg) -> Method` as align.method=`name`, with the checks of the keys it reads
    (`check(cfg)`, run by the verb before anything starts) and the settings that define its run
    (`identity(cfg)`: a resume with others is refused, as for align.method itself); `layout_check(cfg,
    dims)` runs with the layout and the base model's keys known (suite.align.checks.check_align_layout)."""

    def add(compose: Compose) -> Compose:
        if name in METHODS and METHODS[name] is not compose:
            raise ValueError(f"align method {name!r} is registered twice")
        METHODS[name] = compose
        if check is not None:
            CHECKS[name] = check
        if identity is not None:
            IDENTITIES[name] = identity
        if layout_check is not None:
            LAYOUT_CHECKS[name] = layout_check
        return compose

    return add


def registered() -> dict[str, Compose]:
    """Every registered method by name (imports the method modules once)."""
    for module in METHOD_MODULES:
        importlib.import_module(module)
    return METHODS


def method(name: str) -> Compose:
    """The `compose` of align.method=`name`; an unknown name is refused in one line."""
    methods = registered()
    if name not in methods:
        raise ConfigError(
            f"align.method={name!r} is not a registered method; use one of: {', '.join(sorted(methods))}"
        )
    return methods[name]


def check_method(cfg: Any) -> None:
    """align.method is registered and its own checks pass."""
    method(cfg.align.method)
    check = CHECKS.get(cfg.align.method)
    if check is not None:
        check(cfg)


def identity(cfg: Any) -> dict:
    """The settings of align.method's run that a resume must keep (beyond the method and its data)."""
    method(cfg.align.method)
    found = IDENTITIES.get(cfg.align.method)
    return found(cfg) if found is not None else {}


def check_method_layout(cfg: Any, dims: Any) -> None:
    """align.method's own layout check, if it registered one."""
    method(cfg.align.method)
    found = LAYOUT_CHECKS.get(cfg.align.method)
    if found is not None:
        found(cfg, dims)
