"""The layout checks can fail: they see the bugs they exist to catch.

- A gradient-scale bug (every gradient doubled after backward: what summing instead of averaging
  over two data-parallel ranks does) leaves the losses and whole weights of a 10-step run within
  the old tolerances, because AdamW and clipping undo a constant factor; `assert_equivalent`
  rejects it (gradient norm of every step, step-1 gradients).
- `initial_weights`, the start that weight updates are measured from, is the run's real start: a
  run whose learning rate cannot move a weight ends where it rebuilds.
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import COMMON
from tests.helpers import (
    NOISE_ONLY,
    TINY_MODEL,
    assert_close_losses,
    assert_close_weights,
    assert_equivalent,
    final_weights,
    initial_weights,
    run_suite,
    train_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 10


def _args(data, run_dir, *extra: str) -> list[str]:
    return [
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        *COMMON,
        f"train.max_steps={STEPS}",
        *extra,
    ]


def test_a_doubled_gradient_is_caught(tiny_data, tmp_path, monkeypatch):
    from suite.cli import main
    from suite.train.step import TrainStep

    reference = tmp_path / "reference"
    run_suite("pretrain", *_args(tiny_data, reference), check=True)

    forward_backward = TrainStep.forward_backward

    def doubled(self, *args, **kwargs):
        loss = forward_backward(self, *args, **kwargs)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(2.0)
        return loss

    monkeypatch.setattr(TrainStep, "forward_backward", doubled)
    buggy = tmp_path / "doubled"
    assert main(["pretrain", *_args(tiny_data, buggy)]) == 0

    # what the equivalence tests used to check cannot see it ...
    assert_close_losses(train_losses(reference), train_losses(buggy), rtol=1e-4)
    ref_weights, weights = final_weights(reference), final_weights(buggy)
    signal = [k for k in ref_weights if not k.endswith(NOISE_ONLY)]  # as the old check did
    assert_close_weights({k: ref_weights[k] for k in signal}, {k: weights[k] for k in signal}, tol=1e-4)
    # ... the gradient-level checks do: the norm at step 1 is twice the reference's
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_equivalent(reference, buggy)
    with pytest.raises(AssertionError, match="'grad'"):
        assert_equivalent(reference, buggy, norm_rtol=10.0)  # the step-1 gradients alone, too


def test_initial_weights_are_where_a_run_starts(tiny_data, tmp_path):
    run = tmp_path / "still"
    # a learning rate too small to change any fp32 weight: the checkpoint holds the starting point
    run_suite("pretrain", *_args(tiny_data, run, "optim.lr=1e-30", "train.max_steps=1"), check=True)
    start, end = initial_weights(run), final_weights(run)
    assert start.keys() == end.keys()
    for name, value in start.items():  # zero-initialised biases may move by ~1e-32
        assert float((value - end[name]).abs().max()) <= 1e-20, name
