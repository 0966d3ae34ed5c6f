"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math

from suite.config.schema import OptimConfig, SchedConfig

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def lr_at(step: int, optim: OptimConfig, sched: SchedConfig, max_steps: int) -> float:
    """Linear warmup to optim.lr, then cosine/linear decay to min_lr_ratio*lr, constant, or wsd, over
    sched.total_steps when set (a run that stops part-way down a longer schedule), else max_steps."""
    max_steps = sched.total_steps or max_steps
    peak = optim.lr
    warmup = max(0, sched.warmup_steps)
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if sched.name == "constant":
        return peak
    floor = peak * sched.min_lr_ratio
    if sched.name == "wsd":
        start = wsd_decay_start(sched, max_steps)
        if step < start:
            return peak
        # the last step (max_steps - 1) lands on the floor
        return _decayed(
            peak, floor, min(1.0, (step - start + 1) / max(1, max_steps - start)), sched.decay_shape
        )
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if sched.name == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def wsd_decay_start(sched: SchedConfig, max_steps: int) -> int:
    """The first (0-based) step of the decay: it depends only on max_steps, so raising train.max_steps
    on a resumed run moves the decay while every stable-phase step before it keeps the peak lr."""
    decay = math.ceil(sched.decay_fraction * max_steps)
    return max(max(0, sched.warmup_steps), max_steps - decay)


def _decayed(peak: float, floor: float, progress: float, shape: str) -> float:
    if shape == "linear":
        return peak - (peak - floor) * progress
    if shape == "cosine":
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    return floor + (peak - floor) * (1.0 - math.sqrt(progress))  # 1-sqrt (Hägele et al. 2024)
