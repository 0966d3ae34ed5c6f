"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math

from suite.config.schema import OptimConfig, SchedConfig


def lr_at(step: int, optim: OptimConfig, sched: SchedConfig, max_steps: int) -> float:
    """Linear warmup to optim.lr, then cosine/linear decay to min_lr_ratio*lr (or constant)."""
    peak = optim.lr
    warmup = max(0, sched.warmup_steps)
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if sched.name == "constant":
        return peak
    floor = peak * sched.min_lr_ratio
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if sched.name == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
