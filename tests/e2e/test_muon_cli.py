"""optim=muon through the real CLI on one process: kill-and-resume is bitwise (Muon's momentum is in
the checkpoint), and the layouts not built yet are refused in one line before anything starts."""

from __future__ import annotations

import signal

import torch.distributed.checkpoint as dcp

from tests.helpers import TINY_MODEL, final_weights, run_suite, suite_env, train_losses


def _args(run_dir, data, *extra: str) -> list[str]:
    return [
        "pretrain",
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.eval_batches=1",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        "optim=muon",
        "optim.lr=3e-3",
        "sched=wsd",
        "sched.warmup_steps=1",
        "train.max_steps=6",
        "train.save_every=2",
        *extra,
    ]


def test_muon_kill_and_resume_is_bitwise(tmp_path, tiny_data):
    """A run SIGKILLed while saving step 4 resumes from step 2 and ends with the uninterrupted run's
    losses and weights, bitwise. Fails if Muon's momentum buffers were not saved or not restored
    (step 3 would then start from zero momentum), or restored into the wrong parameters."""
    ref, run = tmp_path / "ref", tmp_path / "killed"
    run_suite(*_args(ref, tiny_data), check=True)
    crash = run_suite(*_args(run, tiny_data), env=suite_env(SUITE_FAULT_KILL_IN_SAVE_STEP="4"))
    assert crash.returncode == -signal.SIGKILL, crash.stdout + crash.stderr
    done = run_suite(*_args(run, tiny_data), check=True)
    assert "at step 2" in done.stdout, done.stdout
    assert train_losses(run) == train_losses(ref)
    mine, theirs = final_weights(run), final_weights(ref)
    assert mine.keys() == theirs.keys() and all((mine[k] == theirs[k]).all() for k in theirs)
    keys = dcp.FileSystemReader(str(ref / "checkpoints" / "step_6")).read_metadata().state_dict_metadata
    buffers = [k for k in keys if k.endswith("momentum_buffer")]
    assert buffers and all(".layers." in k or "layers." in k for k in buffers), buffers


def test_muon_refuses_pipeline_parallelism_in_one_line(tmp_path, tiny_data):
    """Fails if optim=muon under pipeline parallelism (not built) started instead of exiting 2 in one
    line before any rank starts (the other layouts: tests/unit/test_muon.py)."""
    layout = "parallel.pp=2"
    proc = run_suite(*_args(tmp_path / "run", tiny_data, layout, "launch.nproc_per_node=2"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "optim.name=muon" in lines[0] and layout in lines[0] and "parallel.dp" in lines[0], lines[0]
