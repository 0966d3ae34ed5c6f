"""Faults a single-process run meets, through the real CLI: NaNs, SIGTERM, a full disk, corrupt
checkpoints, shards and tokenizers. See docs/reliability.md."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TINY_MODEL, final_weights, read_metrics, run_suite, suite_env, train_losses


def args_for(run_dir: Path, data: Path, *extra: str) -> list[str]:
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
        "optim.lr=3e-3",
        *extra,
    ]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").glob("step_*")), key=lambda n: int(n[5:]))


def test_nan_is_skipped_counted_and_retention_keeps_last_and_every(tmp_path, tiny_data):
    run_dir = tmp_path / "nan"
    proc = run_suite(
        *args_for(
            run_dir,
            tiny_data,
            "train.max_steps=8",
            "train.save_every=1",
            "train.inject_nan_steps=[7]",
            "train.keep_last=2",
            "train.keep_every=3",
        ),
        check=True,
    )
    skipped = [line for line in proc.stdout.splitlines() if "optimizer step skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("step 7: loss nan"), proc.stdout
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert records[6]["bad_steps"] == 0 and records[7]["bad_steps"] == records[8]["bad_steps"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["bad_steps"] == 1
    # keep_last=2 -> 7, 8; keep_every=3 -> 3, 6; the rest went
    assert steps_on_disk(run_dir) == ["step_3", "step_6", "step_7", "step_8"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_8"
    # the skipped step changed no weight
    step6 = final_weights(run_dir / "checkpoints" / "step_6")
    step7 = final_weights(run_dir / "checkpoints" / "step_7")
    assert all(torch.equal(step6[k], step7[k]) for k in step6)


def test_nans_in_a_row_stop_the_run_naming_step_and_checkpoint(tmp_path, tiny_data):
    run_dir = tmp_path / "nans"
    proc = run_suite(
        *args_for(
            run_dir, tiny_data, "train.max_steps=10", "train.save_every=2", "train.inject_nan_steps=[3,4,5]"
        )
    )
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert "stopping at step 5: 3 non-finite steps in a row (train.max_bad_steps=3)" in lines[0]
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'step_4'}" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_bad_steps_are_read_at_logging_steps_and_still_stop_the_run(tmp_path, tiny_data, sync_run):
    """The non-finite flag stays on the device between logging steps (fused AdamW skips on its
    own); reading it every 4 steps still counts each bad step and names the third in a row.
    (The loader also prefetches here, data.prefetch=true: the run takes the same batches.)"""
    run_dir = tmp_path / "nans_logged"
    proc = run_suite(
        *args_for(run_dir, tiny_data, "train.max_steps=12", "train.inject_nan_steps=[5,6,7]"),
        "train.log_every=4",
        "train.save_every=100",
        "data.prefetch=true",
    )
    assert proc.returncode == 1, proc.stderr
    assert "stopping at step 7: 3 non-finite steps in a row (train.max_bad_steps=3)" in proc.stderr
    skipped = [line.split(":")[0] for line in proc.stdout.splitlines() if "optimizer step skipped" in line]
    assert skipped == ["step 5", "step 6", "step 7"], proc.stdout
    assert [r["bad_steps"] for r in read_metrics(run_dir) if "loss" in r] == [0]  # step 4 only
    step4 = next(r["loss"] for r in read_metrics(run_dir) if r.get("step") == 4 and "loss" in r)
    # the plain 6-step run (no prefetch; lr still in warm-up, so max_steps does not matter): same batches
    assert step4 == train_losses(sync_run)[4]


def test_sigterm_checkpoints_the_current_step_and_exits_143(tmp_path, tiny_data):
    run_dir = tmp_path / "term"
    args = args_for(run_dir, tiny_data, "train.max_steps=100000", "train.save_every=100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", *args],
        cwd=REPO,
        env=suite_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"loss"') >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out + err
    stop = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stop) == 1, out
    step = int(stop[0].split("at step ")[1].split(";")[0])
    assert step >= 2 and f"step_{step}" in stop[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert max(r["step"] for r in read_metrics(run_dir)) == step
    resumed = run_suite(*args_for(run_dir, tiny_data, f"train.max_steps={step + 1}"), check=True)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} at step {step}" in resumed.stdout


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory, tiny_data):
    """A run whose step-4 save hits ENOSPC (injected) after its model files were written."""
    run_dir = tmp_path_factory.mktemp("enospc") / "run"
    args = args_for(run_dir, tiny_data, "train.max_steps=4", "train.save_every=2")
    proc = run_suite(*args, env=suite_env(SUITE_FAULT_ENOSPC_STEP="4"))
    return run_dir, args, proc


def test_full_disk_during_save_keeps_the_previous_checkpoint(full_disk_run):
    run_dir, args, proc = full_disk_run
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "could not write the checkpoint of step 4" in lines[0] and "No space left on device" in lines[0]
    assert str(run_dir / "checkpoints" / ".tmp-step_4") in lines[0]
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'step_2'}" in lines[0]
    assert steps_on_disk(run_dir) == ["step_2"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    resumed = run_suite(*args, check=True)  # disk "freed": the same command resumes from step 2
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in resumed.stdout
    assert steps_on_disk(run_dir) == ["step_2", "step_4"]


def test_an_os_error_wrapped_by_dcp_is_recognised():
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from suite.train.saver import os_error_in

    full = OSError(errno.ENOSPC, "No space left on device", "/x")
    assert os_error_in(full) is full
    assert os_error_in(CheckpointException("save failed", {1: (full, None)})) is full
    assert os_error_in(CheckpointException("save failed", {0: (ValueError("no"), None)})) is None


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, tiny_data, damage):
    run_dir = tmp_path / damage
    args = args_for(run_dir, tiny_data, "train.max_steps=4", "train.save_every=2")
    run_suite(*args, check=True)
    reference = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    newest = run_dir / "checkpoints" / "step_4"
    victim = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    proc = run_suite(*args, check=True)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("skipping checkpoint step_4")]
    assert len(skipped) == 1, proc.stdout
    assert ("does not match its checksum" if damage == "flip" else "the manifest says") in skipped[0]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in proc.stdout
    again = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    assert again == reference  # steps 3-4 redone bitwise; the rewritten step_4 verifies
    from suite.train.checkpoint import verify

    assert verify(newest) is None


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DATA_DAMAGE = [
    ("train.bin", _flip, "does not match its sha256"),
    ("val.bin", _truncate, "truncated or corrupt"),  # the shard's own size check sees it first
    ("tokenizer.json", _flip, "does not match its sha256"),
]


@pytest.mark.parametrize(
    ("name", "damage", "expected"), DATA_DAMAGE, ids=[f"{n}-{d.__name__[1:]}" for n, d, _ in DATA_DAMAGE]
)
def test_corrupt_data_file_is_one_line_exit_2(tmp_path, tiny_data, name, damage, expected):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    damage(data / name)
    proc = run_suite(*args_for(tmp_path / "run", data, "train.max_steps=2"), timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(data / name) in lines[0] and expected in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_corrupt_tokenizer_in_a_run_folder_is_one_line_exit_2(full_disk_run):
    run_dir, _, _ = full_disk_run
    tokenizer = run_dir / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:100])
    proc = run_suite("generate", f"ckpt={run_dir}", "prompt=The", "generate.max_new_tokens=2", timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "tokenizer" in lines[0] and "could not be loaded" in lines[0], proc.stderr


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, tiny_data):
    """The reference for asynchronous saves: 6 steps, synchronous checkpoints at 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    run_suite(*args_for(run_dir, tiny_data, "train.max_steps=6", "train.save_every=2"), check=True)
    return run_dir


def test_async_save_failures_crashes_and_results_match_sync(sync_run, tmp_path, tiny_data):
    """train.async_save=true: a failed background write is the same one-line error as a synchronous
    one; a crash in the middle of a background write leaves the previous checkpoint loadable; the
    resumed run's losses and checkpoints equal the synchronous run's, bitwise."""
    run_dir = tmp_path / "async"
    args = args_for(run_dir, tiny_data, "train.max_steps=6", "train.save_every=2", "train.async_save=true")

    full = run_suite(*args, env=suite_env(SUITE_FAULT_ENOSPC_STEP="4"))
    assert full.returncode == 1, full.stderr
    assert "writing checkpoint" in full.stdout and "in the background" in full.stdout
    lines = error_lines(full)
    assert len(lines) == 1 and "Traceback" not in full.stderr, full.stderr
    assert lines[0].startswith("error: could not write the checkpoint of step 4 to ")
    assert "No space left on device" in lines[0]
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'step_2'}" in lines[0]
    assert steps_on_disk(run_dir) == ["step_2"] and not list((run_dir / "checkpoints").glob(".tmp-*"))

    crash = run_suite(*args, env=suite_env(SUITE_FAULT_KILL_IN_SAVE_STEP="4"))  # resumes at 2, dies saving 4
    assert crash.returncode == -signal.SIGKILL, crash.stdout + crash.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in crash.stdout
    assert steps_on_disk(run_dir) == ["step_2"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert not (run_dir / "checkpoints" / ".tmp-step_4" / "manifest.json").exists()

    done = run_suite(*args, check=True)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} at step 2" in done.stdout
    assert steps_on_disk(run_dir) == ["step_2", "step_4", "step_6"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    from suite.train.checkpoint import verify

    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    assert losses == {r["step"]: r["loss"] for r in read_metrics(sync_run) if "loss" in r}
    for step in ("step_4", "step_6"):
        assert verify(run_dir / "checkpoints" / step) is None
        mine, ref = (
            final_weights(run_dir / "checkpoints" / step),
            final_weights(sync_run / "checkpoints" / step),
        )
        assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def test_loss_spike_rolls_back_and_skips_the_batch(tmp_path, tiny_data):
    run_dir = tmp_path / "spike"
    proc = run_suite(
        *args_for(
            run_dir,
            tiny_data,
            "train.max_steps=8",
            "train.save_every=2",
            "train.spike_factor=3",
            "train.spike_window=2",
            "train.inject_spike_batches=[6]",  # the batch step 6 would train on: its loss x100
        ),
        check=True,
    )
    rollbacks = [line for line in proc.stdout.splitlines() if "rolled back to" in line]
    assert len(rollbacks) == 1, proc.stdout
    assert (
        rollbacks[0].startswith("step 6: loss ")
        and "more than train.spike_factor=3 x the mean" in rollbacks[0]
    )
    assert (
        f"rolled back to {run_dir / 'checkpoints' / 'step_4'} (step 4) and skipping batch 6" in rollbacks[0]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 8 and summary["skipped_batches"] == [6]
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 9))  # each step once: the rolled-back records were rewritten
    state = torch.load(run_dir / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    assert state["skipped_batches"] == [6] and state["data"]["position"] == 9  # 9 batches drawn, 8 trained
