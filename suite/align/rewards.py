"""GRPO's rewards, by name: `align.grpo.reward` names one or more (comma-separated, summed).

    exact            1.0 when the completion is the task's answer (suite.data.tasks.score), else 0.0
    format           1.0 when the completion has the answer's form (digits only, nothing else), else 0.0
    module:function  a Python callable, imported only when named: function(prompt, completion, answer)
                     -> a number (prompt: the question's text; completion: the decoded reply)

A reward that raises or returns something other than a finite number stops the run with one line
naming the reward, the completion and what it returned; a silently wrong reward would train the model
towards it.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

from suite.config.errors import ConfigError
from suite.data.tasks import score

RewardFn = Callable[[str, str, str], object]  # (prompt, completion, answer) -> a number
KEY = "align.grpo.reward"
REWARDS: dict[str, Callable[[str], RewardFn]] = {}  # name -> factory(task name) -> reward


def register(name: str) -> Callable:
    def add(factory: Callable[[str], RewardFn]) -> Callable[[str], RewardFn]:
        REWARDS[name] = factory
        return factory

    return add


@register("exact")
def _exact(task: str) -> RewardFn:
    return lambda prompt, completion, answer: 1.0 if score(task, completion, answer) else 0.0


_DIGITS = re.compile(r"^\s*\d+\s*$")


@register("format")
def _format(task: str) -> RewardFn:
    return lambda prompt, completion, answer: 1.0 if _DIGITS.match(completion) else 0.0


def _callable(spec: str) -> RewardFn:
    """`module:function`, imported now (only when a run names it)."""
    module_name, _, attr = spec.partition(":")
    fix = "name an importable module and a function in it, e.g. align.grpo.reward=my_rewards:score"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any import error is theirs, reported in one line
        raise ConfigError(
            f"{KEY}='{spec}': importing {module_name} failed ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{KEY}='{spec}': {module_name} has no function {attr!r}; {fix}")
    return fn


def parse(spec: str) -> list[str]:
    """The reward names of `spec`; an unknown plain name is refused in one line (no import yet)."""
    names = [part.strip() for part in str(spec).split(",") if part.strip()]
    if not names:
        raise ConfigError(f"{KEY}='{spec}' names no reward; use {' | '.join(REWARDS)} | module:function")
    for name in names:
        if ":" not in name and name not in REWARDS:
            raise ConfigError(
                f"{KEY}={name!r} is not a reward; use {', '.join(REWARDS)} or module:function "
                "(a Python function(prompt, completion, answer) -> number)"
            )
    return names


@dataclass
class Rewards:
    """The summed rewards `spec` names, for a built-in task's completions."""

    spec: str
    task: str

    def __post_init__(self) -> None:
        self.names = parse(self.spec)
        self.fns = [_callable(n) if ":" in n else REWARDS[n](self.task) for n in self.names]

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        total = 0.0
        for name, fn in zip(self.names, self.fns):
            try:
                value = fn(prompt, completion, answer)
            except Exception as exc:  # the user's function: stop in one line, not a traceback
                raise ConfigError(
                    f"{KEY}: reward {name!r} raised {type(exc).__name__}: {exc} on the completion {completion!r}; "
                    "fix the function (it must return a number for every completion)"
                ) from None
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ConfigError(
                    f"{KEY}: reward {name!r} returned {value!r} ({type(value).__name__}) for the completion "
                    f"{completion!r}; a reward must return a finite number (int or float)"
                )
            total += float(value)
        return total
