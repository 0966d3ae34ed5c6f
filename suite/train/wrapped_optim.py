"""The base of optimizers that update other tensors than the model's parameters (fp32 masters,
ZeRO-1 slices): its own module so that suite.train.optim can build them without an import circle."""

from __future__ import annotations

import abc

import torch
from torch import nn


class WrappedOptimizer(abc.ABC):
    """The part of torch's Optimizer the trainer uses, for optimizers that update other tensors than
    the model's parameters (fp32 masters, ZeRO-1 row slices) through an inner torch optimizer: the
    lr schedule writes `param_groups`, checkpoints read `state`, `zero_grad` clears the model's grads.
    Subclasses set `model` and `inner` and write `_update`."""

    model: nn.Module
    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise RuntimeError(f"{type(self).__name__}.step does not take a closure")
        self._update()

    @abc.abstractmethod
    def _update(self) -> None:
        """The update itself (runs under no_grad)."""
