"""fp16's loss scale is training state: a resumed run goes on with the scale it had reached.

One process, the tiny model in fp16 (emulated on this CPU), 6 steps with checkpoints at 3 and 6. An
inf is written into the gradient at step 2 (SUITE_FAULT_INF_GRAD=0:2), so the step is skipped and
the scale halved from 2^16 to 2^15. The step-3 checkpoint, copied into a fresh run folder and resumed
to step 6, must log the same scale and the same losses as the run that never stopped (before the
scaler's state was saved, it restarted at 2^16). A checkpoint written before that (no scaler state in
trainer_state.pt) still resumes, at the initial scale.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from suite.train.checkpoint import write_manifest
from suite.train.loss_scale import SCALER_KEY
from tests.helpers import TINY_MODEL, assert_close_losses, read_metrics, run_suite, suite_env, train_losses

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = [
    *TINY_MODEL,
    "train.precision=fp16",
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


def pretrain(run_dir, data, **env: str) -> None:
    run_suite("pretrain", *ARGS, f"data.path={data}", f"run.dir={run_dir}", env=suite_env(**env), check=True)


def loss_scales(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss_scale"] for r in read_metrics(run_dir) if "loss_scale" in r}


def resumed_from_step_3(source, run_dir, data, strip_scaler: bool = False):
    folder = run_dir / "checkpoints" / "step_3"
    shutil.copytree(source / "checkpoints" / "step_3", folder)
    if strip_scaler:  # as a checkpoint written before the scaler was kept
        state = torch.load(folder / "trainer_state.pt", weights_only=True)
        del state[SCALER_KEY]
        torch.save(state, folder / "trainer_state.pt")
        write_manifest(folder, 3)  # the checksums cover trainer_state.pt
    pretrain(run_dir, data)
    return run_dir


def test_resumed_fp16_run_keeps_its_loss_scale(tiny_data, tmp_path):
    whole = tmp_path / "whole"
    pretrain(whole, tiny_data, SUITE_FAULT_INF_GRAD="0:2")
    scales = loss_scales(whole)
    assert scales == {1: 2.0**16, 2: 2.0**15, 3: 2.0**15, 4: 2.0**15, 5: 2.0**15, 6: 2.0**15}, scales

    resumed = resumed_from_step_3(whole, tmp_path / "resumed", tiny_data)
    assert loss_scales(resumed) == {s: v for s, v in scales.items() if s > 3}
    later = {s: v for s, v in train_losses(whole).items() if s > 3}
    assert_close_losses(later, train_losses(resumed), rtol=1e-6)

    old = resumed_from_step_3(whole, tmp_path / "old", tiny_data, strip_scaler=True)
    assert loss_scales(old) == {4: 2.0**16, 5: 2.0**16, 6: 2.0**16}
