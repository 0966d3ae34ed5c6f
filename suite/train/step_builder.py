"""`build_step`: the one constructor of a training step, for every layout and every training method.
Its own module so that suite.train.step and suite.train.pipeline_step do not import each other."""

from __future__ import annotations

from collections.abc import Callable

import torch

from suite.parallel.parallelize import Placement
from suite.train.pipeline_step import PipelineStep
from suite.train.step import LossFn, TrainStep


def build_step(
    placement: Placement,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    autocast: Callable,
    scaler: torch.amp.GradScaler,
    **options,
) -> TrainStep:
    """The step for this placement: the accumulation loop, or the pipeline schedule (pp > 1).
    `options`: TrainStep's keyword arguments."""
    if placement.pipeline is not None:
        return PipelineStep(placement, optimizer, loss_fn, autocast, scaler, **options)
    return TrainStep(placement, optimizer, loss_fn, autocast, scaler, **options)
