"""What a training run is composed of around the loop: a training method (its data and its hooks)
and components, each called by the loop at fixed points.

A component changes the meta model before `parallelize` (fake quantization, LoRA adapters, the
projections of hidden-state distillation), loads weights, supplies the step's training loss (a frozen
teacher; later a reference model or a reward), acts around each optimizer step (the expert-bias update,
the tests' fault injection), adds metrics to the log and to each evaluation, and adds files to the run
folder and to checkpoints. The loop (suite.train.trainer) calls the hooks of every component in order
and knows none of them by name; finetuning and distillation are compositions, not subclasses.

Test aids: `SUITE_TEST_COMPONENTS` names Python files (os.pathsep-separated) whose `components(cfg)`
returns more components; the tests' fault injection (tests/fault_injection.py) is added this way, so
no test hook lives in the loop. The train.inject_* / train.fault_kill_* keys act only through it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.train.step import MethodLoss

TEST_COMPONENTS_ENV = "SUITE_TEST_COMPONENTS"
# The running suite.train.trainer.Trainer, as the hooks receive it; not imported (the trainer imports
# this module, and no file here imports another in a circle).
Trainer = Any


class Component:
    """A part of a run that the loop calls at fixed points; every hook is optional (no-op here)."""

    def adapt_model(self, trainer: Trainer, model: torch.nn.Module) -> None:
        """Change the meta-device model before parallelize."""

    def load_weights(self, trainer: Trainer) -> None:
        """Replace the seeded initialisation of `trainer.model` (after materialising)."""

    def weights_ready(self, trainer: Trainer) -> None:
        """The weights are final (after every component's load_weights), before the optimizer exists."""

    def step_loss(self, trainer: Trainer) -> MethodLoss | None:
        """The training method's loss for the step (suite.train.step.MethodLoss); at most one component."""
        return None

    def before_step(self, trainer: Trainer) -> None:
        """Before the optimizer step numbered `trainer.step + 1` runs on `trainer.batch_number`."""

    def adjust_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """The step's global loss after the backward, before the finiteness checks."""
        return loss

    def after_step(self, trainer: Trainer) -> None:
        """After the optimizer step, on every rank, every step."""

    def log_metrics(self, trainer: Trainer, window_steps: int) -> dict:
        """Added to a logged step's record (`window_steps`: steps since the last logged one)."""
        return {}

    def eval_metrics(self, trainer: Trainer) -> dict:
        """Added to each evaluation's metrics (after val_loss)."""
        return {}

    def write_run_files(self, trainer: Trainer) -> None:
        """Rank 0, at the start of the loop: files beside config.yaml."""

    def checkpoint_extra(self, trainer: Trainer) -> Callable[[Path], None] | None:
        """A callable(tmp folder) rank 0 runs inside each checkpoint; collective work happens here."""
        return None

    def finish(self, trainer: Trainer, summary: dict) -> None:
        """After the loop and its last checkpoint (every rank)."""


class Data:
    """A training method's data: prepared before the model is built, loaders once it is placed."""

    data_dir: Path | None = None  # prepared pretraining data (the run folder's identity), if any
    # sequences one sample of the global batch holds (tokens_per_s and MFU count them): a preference
    # pair is two, its chosen and its rejected conversation
    rows_per_sample: int = 1

    def prepare(self, trainer: Trainer) -> None:
        """Files, tokenizer and checks, before the model exists."""
        raise NotImplementedError

    def loaders(self, trainer: Trainer) -> tuple[Any, Any]:
        """(training batches, held-out batches) for this rank (`trainer.placement.dp_rank`)."""
        raise NotImplementedError

    def write_run_files(self, trainer: Trainer) -> None:
        """Rank 0: the tokenizer beside config.yaml."""

    def vocab(self) -> dict:
        """The tokenizer's vocabulary (distillation checks the teacher's against it)."""
        raise NotImplementedError


@dataclass
class Method:
    """A training method composed for one run: its name (the verb that runs it), data and components."""

    name: str
    data: Data
    components: list[Component] = field(default_factory=list)


def test_components(cfg: SuiteConfig) -> list[Component]:
    """The components the files named by SUITE_TEST_COMPONENTS add (test aids; module docstring)."""
    found: list[Component] = []
    for path in filter(None, os.environ.get(TEST_COMPONENTS_ENV, "").split(os.pathsep)):
        spec = importlib.util.spec_from_file_location(f"suite_test_components_{Path(path).stem}", path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{TEST_COMPONENTS_ENV}={path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found.extend(module.components(cfg))
    t = cfg.train
    aids = {
        "train.inject_nan_steps": t.inject_nan_steps,
        "train.inject_spike_batches": t.inject_spike_batches,
        "train.fault_kill_step": t.fault_kill_step,
    }
    used = [key for key, value in aids.items() if value not in (None, [], ())]
    if used and not any(getattr(c, "injects_faults", False) for c in found):
        raise ConfigError(
            f"{', '.join(used)}: test aids, acted on only by the tests' fault injection "
            f"({TEST_COMPONENTS_ENV}=tests/fault_injection.py); unset them"
        )
    return found
