"""sched=wsd: the learning rate at every step equals the closed form written out by hand here."""

from __future__ import annotations

import math

import pytest

from suite.config.schema import OptimConfig, SchedConfig
from suite.train.schedule import lr_at


def _closed_form(step: int, shape: str) -> float:
    """peak 1.0, floor 0.1, warmup 3, max_steps 20, decay_fraction 0.25: decay over steps 15..19."""
    if step < 3:
        return (step + 1) / 3
    if step < 15:
        return 1.0
    p = (step - 14) / 5  # 0.2, 0.4, ..., 1.0 at the last step
    decayed = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(p)}[
        shape
    ]
    return 0.1 + 0.9 * decayed


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_lr_equals_the_closed_form_at_every_step(shape):
    """Fails if the decay starts one step early or late (an off-by-one in the decay start), misses the
    floor at the last step, or uses another shape's formula."""
    sched = SchedConfig(name="wsd", warmup_steps=3, min_lr_ratio=0.1, decay_fraction=0.25, decay_shape=shape)
    optim = OptimConfig(lr=1.0)
    for step in range(20):
        assert lr_at(step, optim, sched, 20) == pytest.approx(_closed_form(step, shape), abs=1e-12), step


def test_raising_max_steps_keeps_the_stable_phase_and_moves_the_decay():
    """Fails if the decay start is derived from anything but max_steps (e.g. a schedule state saved at
    the first run's length), which would decay a resumed, extended run at the old end."""
    sched = SchedConfig(name="wsd", warmup_steps=2, decay_fraction=0.2)
    optim = OptimConfig(lr=1.0)
    short = [lr_at(s, optim, sched, 10) for s in range(10)]
    long = [lr_at(s, optim, sched, 40) for s in range(40)]
    assert short[:8] == long[:8]  # the short run decays from step 8
    assert short[8] < 1.0 and long[8:32] == [1.0] * 24 and long[32] < 1.0


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd"])
def test_total_steps_stops_a_run_part_way_down_a_longer_schedule(name):
    """sched.total_steps=40 with max_steps 30 gives each of the 30 steps the lr of the 40-step run, still
    above the floor at the last one. Fails if lr_at decays over train.max_steps regardless (the key
    ignored), which would end this run on the floor."""
    optim = OptimConfig(lr=1.0)
    longer = SchedConfig(name=name, warmup_steps=3, min_lr_ratio=0.1)
    stopped = SchedConfig(name=name, warmup_steps=3, min_lr_ratio=0.1, total_steps=40)
    for step in range(30):
        assert lr_at(step, optim, stopped, 30) == lr_at(step, optim, longer, 40), step
    assert lr_at(29, optim, stopped, 30) > lr_at(29, optim, longer, 30) + 1e-3
