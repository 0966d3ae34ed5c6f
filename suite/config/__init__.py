"""Structured configs, Hydra composition and validation.

The names below load on first use (PEP 562): importing `suite.config.errors` (every module that
refuses input does) must not pay for Hydra, e.g. in `suite prepare`'s worker processes."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "compose_config": "suite.config.compose",
    "known_options": "suite.config.compose",
    "recipe_search_dirs": "suite.config.compose",
    "ConfigError": "suite.config.errors",
    "SuiteConfig": "suite.config.schema",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'suite.config' has no attribute '{name}'")
