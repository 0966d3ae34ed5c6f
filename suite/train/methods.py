"""The training methods by name, and `run_method`: the one way a training verb runs in a rank.

A method is a module with `compose(cfg) -> suite.train.components.Method`: its data and its
components (docs/architecture.md, "Adding a training method"). The table names modules rather than
importing them because the methods sit above this package (finetuning reads model sources, which
read checkpoints written here); a method's module is imported when a run asks for it.
"""

from __future__ import annotations

import importlib

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.parallel.dims import ParallelDims
from suite.train.components import Method
from suite.train.trainer import Trainer

METHODS: dict[str, str] = {
    "pretrain": "suite.pretrain.method",
    "finetune": "suite.finetune.method",
    "distill": "suite.distill.method",
}


def compose_method(name: str, cfg: SuiteConfig) -> Method:
    """The method `name` composed for `cfg` (its data and components, nothing built yet)."""
    if name not in METHODS:
        raise ConfigError(f"{name!r} is not a training method; use one of {', '.join(METHODS)}")
    return importlib.import_module(METHODS[name]).compose(cfg)  # the table's module (module docstring)


def run_method(name: str, cfg: SuiteConfig, dims: ParallelDims, resolved_yaml: str) -> None:
    """Build the trainer of method `name` from its composed parts and run it (every rank)."""
    Trainer(cfg, dims, resolved_yaml, compose_method(name, cfg)).train()
