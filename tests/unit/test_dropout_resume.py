"""The RNG is training state: a run with dropout, resumed from a checkpoint, draws the same dropout
masks as the run that never stopped (suite.train.checkpoint saves and restores each rank's RNG).

No other resume test draws from the RNG after the resume (they train without dropout), so skipping
the restore passed them all (issue 39). One process, the tiny model with model.dropout=0.2, 6 steps
with checkpoints at 3 and 6; the step-3 checkpoint, copied into a fresh run folder and resumed to
step 6, must log the same losses, bitwise (same process count, same kernels, same masks).
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import TINY_MODEL, run_suite, suite_env, train_losses

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = [
    *TINY_MODEL,
    "model.dropout=0.2",
    "log.report=false",
    "train.log_every=1",
    "train.save_every=3",
    "train.eval_every=6",
    "train.eval_batches=1",
    "parallel.global_batch_size=8",
    "parallel.micro_batch_size=4",
    "optim.lr=3e-3",
    "train.max_steps=6",
]


def pretrain(run_dir, data) -> None:
    run_suite("pretrain", *ARGS, f"data.path={data}", f"run.dir={run_dir}", env=suite_env(), check=True)


def test_a_resumed_run_draws_the_same_dropout_masks(tiny_data, tmp_path):
    whole = tmp_path / "whole"
    pretrain(whole, tiny_data)
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")
    pretrain(resumed, tiny_data)
    later = {s: v for s, v in train_losses(whole).items() if s > 3}
    assert train_losses(resumed) == later, (train_losses(resumed), later)
