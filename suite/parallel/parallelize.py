"""`parallelize`: the one place where a plain model becomes a parallel one.

It returns a ParallelModel, which owns how a step's micro-batches run (plain loop, or a pipeline
schedule), how gradients are clipped (norms across shards and stages) and how evaluation runs,
so the trainer's loop reads the same for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from suite.config.schema import SuiteConfig
from suite.parallel.dims import ParallelDims

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ParallelModel:
    model: nn.Module
    dims: ParallelDims
    dp_rank: int = 0
    materialized: bool = False
    num_params: int = 0
    extras: dict = field(default_factory=dict)

    def forward_backward(self, micro_batches: list[torch.Tensor], loss_fn: LossFn, autocast, scaler) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns the mean loss (detached)."""
        device = next(self.model.parameters()).device
        total = torch.zeros((), device=device)
        for batch in micro_batches:
            batch = batch.to(device, non_blocking=True)
            with autocast():
                logits = self.model(batch[:, :-1])
                loss = loss_fn(logits, batch[:, 1:]) / len(micro_batches)
            scaler.scale(loss).backward()
            total += loss.detach()
        return total

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor], loss_fn: LossFn, autocast) -> float:
        device = next(self.model.parameters()).device
        losses = []
        for batch in batches:
            batch = batch.to(device)
            with autocast():
                losses.append(loss_fn(self.model(batch[:, :-1]), batch[:, 1:]).float())
        return float(torch.stack(losses).mean())


def parallelize(model: nn.Module, cfg: SuiteConfig, dims: ParallelDims, device: torch.device) -> ParallelModel:
    """Apply the recipe's parallelism to a meta-device model (single process: compile only)."""
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names (and so checkpoints) stay the same
    return ParallelModel(model=model, dims=dims, num_params=model.num_params())
