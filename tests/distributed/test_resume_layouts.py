"""Saved at one layout, resumed at another: the loss continues as in the uninterrupted run.

The source run's step-5 checkpoint (DCP: model + AdamW state in their global layout, data position)
is copied into a fresh run directory and training continues to step 10 under another layout;
steps 6-10 (losses, gradient norms) and the weight updates must match the single-process run that never stopped.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.conftest import LAYOUTS, pretrain
from tests.helpers import assert_equivalent, assert_layout, train_losses

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def resume_elsewhere(layout_run, tiny_data, tmp_path, source: str, target: str):
    src = layout_run(source)
    run_dir = tmp_path / f"{source}-to-{target}"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "step_5", run_dir / "checkpoints" / "step_5")
    nproc, overrides = LAYOUTS[target]
    pretrain(run_dir, tiny_data, nproc, *overrides)
    assert_layout(run_dir, nproc, overrides)
    assert sorted(train_losses(run_dir)) == list(range(6, 11))
    assert_equivalent(layout_run("single"), run_dir, from_step=5, grad_step=None)


@pytest.mark.slow
def test_sharding4_checkpoint_resumes_at_tp2_dp2(layout_run, tiny_data, tmp_path):
    resume_elsewhere(layout_run, tiny_data, tmp_path, "sharding4-stage3", "dp2-tp2")


def test_tp2_checkpoint_resumes_in_one_process(layout_run, tiny_data, tmp_path):
    resume_elsewhere(layout_run, tiny_data, tmp_path, "tp2", "single")


def test_tp2_checkpoint_resumes_under_zero1(layout_run, tiny_data, tmp_path):
    """ZeRO-1 keeps its own sharded optimizer state; it reads a TP checkpoint's AdamW moments."""
    resume_elsewhere(layout_run, tiny_data, tmp_path, "tp2", "sharding2-stage1")
