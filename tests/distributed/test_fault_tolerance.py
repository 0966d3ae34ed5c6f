"""Faults with real processes: a rank that SIGKILLs itself at a step boundary (injected with
train.fault_kill_rank/fault_kill_step; tests/distributed/test_real_faults.py kills from outside)
comes back through the elastic launcher (launch.max_restarts=1) and ends where an uninterrupted run
ends; SIGTERM to a launched job checkpoints the current step. See docs/reliability.md."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.conftest import COMMON, LAYOUTS, STEPS
from tests.helpers import (
    REPO,
    TINY_MODEL,
    assert_close_losses,
    assert_close_updates,
    assert_layout,
    read_metrics,
    run_suite,
    suite_env,
    train_losses,
)

SAVE_EVERY = 5  # COMMON's train.save_every
KILL_STEP = 7  # rank 2 dies before step 7: steps 6.. are lost, the restart resumes from step_5


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sharding4-stage3", "dp2-tp2"])
def test_killed_rank_is_restarted_and_the_run_ends_like_an_uninterrupted_one(
    layout, layout_run, tiny_data, tmp_path
):
    nproc, overrides = LAYOUTS[layout]
    run_dir = tmp_path / layout
    proc = run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        *COMMON,
        f"train.max_steps={STEPS}",
        *overrides,
        f"launch.nproc_per_node={nproc}",
        "launch.max_restarts=1",
        "train.fault_kill_rank=2",
        f"train.fault_kill_step={KILL_STEP}",
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = re.findall(r"resumed from \S+step_(\d+) at step (\d+)", proc.stdout)
    # exactly one restart, from the newest checkpoint before the kill: step 6 is redone
    assert resumed == [(str(SAVE_EVERY), str(SAVE_EVERY))], proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
    assert max(r["step"] for r in read_metrics(run_dir)) == STEPS
    assert_layout(run_dir, nproc, overrides)
    assert_close_losses(train_losses(layout_run(layout)), train_losses(run_dir), rtol=1e-4)
    assert_close_updates(layout_run(layout), run_dir, tol=1e-4)


@pytest.mark.slow
def test_sigterm_to_a_launched_job_checkpoints_the_current_step(tiny_data, tmp_path):
    run_dir = tmp_path / "term"
    args = [
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        *COMMON,
        "train.max_steps=100000",
        "train.save_every=100000",
        "train.eval_every=100000",
        "parallel.dp=2",
        "launch.nproc_per_node=2",
    ]
    job = subprocess.Popen(
        [sys.executable, "-m", "suite", *args],
        cwd=REPO,
        env=suite_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:
            if metrics.is_file() and metrics.read_text().count('"loss"') >= 2:
                break
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)  # as Slurm does before preemption
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, out
    stop = re.findall(r"stopped by SIGTERM at step (\d+); saved checkpoint (\S+);", out)
    assert len(stop) == 1, out
    step = int(stop[0][0])
    assert stop[0][1] == str(run_dir / "checkpoints" / f"step_{step}")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    from suite.train.checkpoint import verify

    assert verify(run_dir / "checkpoints" / f"step_{step}") is None


@pytest.mark.slow
def test_elastic_job_loses_a_device_and_finishes_on_fewer_processes(layout_run, tiny_data, tmp_path):
    """launch.nproc_per_node=2:4 with sharding=auto: rank 2 is SIGKILLed before step 7 and its slot
    counts as a lost device (SUITE_FAULT_LOSE_DEVICE=1), 3 ranks cannot split the global batch of 16
    in micro-batches of 4, so the job restarts on 2, resharding the step-5 checkpoint (written
    asynchronously by 4 ranks) to sharding=2; the losses equal an uninterrupted sharding=4 run's."""
    run_dir = tmp_path / "elastic"
    proc = run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        *COMMON,
        f"train.max_steps={STEPS}",
        "parallel.sharding=auto",
        "launch.nproc_per_node=2:4",
        "launch.max_restarts=1",
        "train.async_save=true",
        "train.fault_kill_rank=2",
        f"train.fault_kill_step={KILL_STEP}",
        env=suite_env(SUITE_FAULT_LOSE_DEVICE="1"),
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    restarts = [line for line in proc.stdout.splitlines() if "restarting on" in line]
    assert len(restarts) == 1, proc.stdout
    assert restarts[0].startswith("pretrain failed, rank 2 exited with code -9")
    assert "device slot 2 counts as lost (3 left); restarting on 2 processes" in restarts[0]
    resumed = re.findall(
        r"resumed from \S+step_(\d+) at step (\d+) \(saved by 4 processes, resharded to 2\)", proc.stdout
    )
    assert resumed == [("5", "5")], proc.stdout
    assert "world 2 (sharding=2)" in proc.stdout
    assert_layout(run_dir, 2, ["parallel.sharding=2"])  # the restarted attempt's layout
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
    assert_close_losses(train_losses(layout_run("sharding4-stage3")), train_losses(run_dir), rtol=1e-4)
