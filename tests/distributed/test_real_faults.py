"""Real faults, nothing injected: the test finds a worker's pid through /proc and SIGKILLs it, as the
OOM killer or a failing node would, at a seeded random moment and in the middle of a synchronous
two-rank save; with launch.max_restarts=1 the job ends like an uninterrupted run (losses and weight
updates), and the steps it redoes are exactly those between the newest complete checkpoint at the
kill and the step the killed attempt had reached. And a real full disk: a 2 MB tmpfs (mounted by the
test, as root) runs out of space in the middle of a two-rank save. Nothing in the workers
cooperates (no fault-injection setting or environment variable). See docs/reliability.md."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# imported before any job starts: the kill must follow the moment the test waits for without delay
from suite.train.checkpoint import MANIFEST, verify
from tests.distributed.conftest import COMMON, LAYOUTS, STEPS
from tests.helpers import (
    REPO,
    TINY_MODEL,
    assert_close_losses,
    assert_close_updates,
    assert_layout,
    final_weights,
    process_gone,
    read_metrics,
    run_suite,
    suite_env,
    train_losses,
    worker_pids,
)

needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")

LAYOUT = "sharding2-stage3"
SAVE_EVERY = 5  # COMMON's train.save_every
SEED = 27  # picks the rank and the moment of the random kill; change it to try another
STEP_LINE = re.compile(r"^step (\d+) \| loss", re.MULTILINE)
BANNER = re.compile(r"^suite pretrain .* parameters, world ", re.MULTILINE)


def _start(run_dir: Path, data: Path, log: Path) -> subprocess.Popen:
    nproc, overrides = LAYOUTS[LAYOUT]
    args = [
        "pretrain",
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        *COMMON,
        f"train.max_steps={STEPS}",
        *overrides,
        f"launch.nproc_per_node={nproc}",
        "launch.max_restarts=1",
    ]
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "suite", *args],
            cwd=REPO,
            env=suite_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(condition, job: subprocess.Popen, what: str, log: Path, timeout: float = 300, poll=0.005):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = condition()
        if found:
            return found
        assert job.poll() is None, f"the job ended before {what}:\n{log.read_text()}"
        time.sleep(poll)
    raise AssertionError(f"no {what} within {timeout} s:\n{log.read_text()}")


def _both_workers(job: subprocess.Popen) -> dict[int, int] | None:
    """{rank: pid} of the first attempt's two workers, once both are running."""
    found = worker_pids(job.pid, attempt=0)
    return found if len(found) == 2 else None


def _metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [int(m) for m in re.findall(r'"step": (\d+), "loss"', path.read_text())]


def _stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _listing(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(os.listdir(root)) if root.is_dir() else []


def _kill(job: subprocess.Popen, pid: int, run_dir: Path, log: Path) -> dict:
    """SIGKILL `pid` and record what was on disk: the checkpoints folder listing once the killed
    process is gone (`at_kill`), and, once every other worker of the first attempt has exited too
    (the survivor fails on its closed connections, or the agent stops it), the checkpoints that
    verify and the steps metrics.jsonl holds: all the first attempt left. The restarted workers need
    seconds to start, so nothing of theirs is on disk yet."""
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: process_gone(pid), job, f"the end of the killed worker {pid}", log)
    at_kill = _listing(run_dir)
    first_attempt = worker_pids(job.pid, attempt=0).values()
    _wait_for(lambda: all(process_gone(p) for p in first_attempt), job, "the end of the first attempt", log)
    root = run_dir / "checkpoints"
    complete = [
        int(name.removeprefix("step_"))
        for name in _listing(run_dir)
        if name.startswith("step_") and (root / name / MANIFEST).is_file() and verify(root / name) is None
    ]
    return {"at_kill": at_kill, "complete": sorted(complete), "metric_steps": _metric_steps(run_dir)}


def _finish(job: subprocess.Popen, log: Path) -> str:
    try:
        job.wait(timeout=420)
    finally:
        _stop(job)
    out = log.read_text()
    assert job.returncode == 0, out
    return out


def _check_redone_steps(out: str, at_kill: dict, run_dir: Path, rank: int) -> tuple[int, int]:
    """The restart resumed from the newest checkpoint complete when the first attempt ended, which is
    the newest at the kill (or, when rank 1 was killed, the save rank 0 was completing then) and redid
    exactly the steps after it that the first attempt had reached: returns (reached, resumed)."""
    banners = [m.start() for m in BANNER.finditer(out)]
    assert len(banners) == 2, out  # one restart
    first = [int(s) for s in STEP_LINE.findall(out[banners[0] : banners[1]])]
    second = [int(s) for s in STEP_LINE.findall(out[banners[1] :])]
    # step reached before the kill: what metrics.jsonl held when the first attempt ended (rank 0 writes
    # a record before it prints the step's line, so a kill in between leaves the line out)
    reached = max(at_kill["metric_steps"], default=0)
    assert first == list(range(1, len(first) + 1)) and reached in (len(first), len(first) + 1), (
        first,
        at_kill,
    )
    resumed = re.findall(r"resumed from (\S+)/step_(\d+) at step (\d+)", out)
    newest = max(at_kill["complete"], default=0)
    newest_at_kill = max((int(n[5:]) for n in at_kill["at_kill"] if n.startswith("step_")), default=0)
    # only rank 0 completes checkpoints: killed, it completes nothing more; a survivor may finish
    # the save in flight (every rank's files were written)
    assert newest == newest_at_kill or (rank != 0 and f".tmp-step_{newest}" in at_kill["at_kill"]), at_kill
    if newest:
        assert resumed == [(str(run_dir / "checkpoints"), str(newest), str(newest))], (resumed, at_kill, out)
    else:
        assert resumed == [], out  # no checkpoint yet: the restart starts over
    assert second == list(range(newest + 1, STEPS + 1)), (second, out)
    redone = [step for step in second if step <= reached]
    assert redone == list(range(newest + 1, reached + 1))
    assert len(redone) == reached - newest <= SAVE_EVERY
    assert sorted(r["step"] for r in read_metrics(run_dir) if "loss" in r) == list(range(1, STEPS + 1))
    return reached, newest


@pytest.mark.slow
@needs_proc
def test_worker_killed_from_outside_at_a_random_moment_is_restarted_exactly(layout_run, tiny_data, tmp_path):
    """A seeded random rank is SIGKILLed a seeded random delay after a seeded random step has been
    logged (the step it lands in depends on the machine's speed; the accounting below does not)."""
    rng = random.Random(SEED)
    rank, after_step, delay = rng.randrange(2), rng.randint(1, 7), rng.uniform(0.0, 0.25)
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    job = _start(run_dir, tiny_data, log)
    try:
        _wait_for(
            lambda: max(_metric_steps(run_dir), default=0) >= after_step, job, f"step {after_step}", log
        )
        time.sleep(delay)
        workers = _wait_for(lambda: _both_workers(job), job, "workers", log)
        at_kill = _kill(job, workers[rank], run_dir, log)
    except BaseException:
        _stop(job)
        raise
    out = _finish(job, log)
    reached, resumed = _check_redone_steps(out, at_kill, run_dir, rank)
    print(
        f"seed {SEED}: rank {rank} killed {delay:.3f} s after step {after_step} was logged; first attempt "
        f"reached step {reached}, restart resumed from step {resumed}, {reached - resumed} steps redone"
    )
    ref = layout_run(LAYOUT)
    assert_close_losses(train_losses(ref), train_losses(run_dir), rtol=1e-4)
    assert_layout(run_dir, *LAYOUTS[LAYOUT])
    assert_close_updates(ref, run_dir, tol=1e-4)


# (rank, what the test waits for inside `.tmp-step_10` before it kills; None: the folder itself)
SAVE_KILLS = {
    # rank 0 completes every checkpoint (manifest, rename, `latest`): killed as the save begins
    "rank0-as-the-save-begins": (0, None),
    # rank 1 killed once it has written its first file of the save (its RNG state), on its way into
    # DCP's planning and writes; rank 0, which waits for it there, fails on the closed connection
    "rank1-in-its-part-of-the-save": (1, "rng_rank1.pt"),
}


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("case", SAVE_KILLS)
def test_rank_killed_from_outside_during_a_synchronous_save_is_restarted_exactly(
    case, layout_run, tiny_data, tmp_path
):
    """A rank is SIGKILLed in the middle of the synchronous save of the last step (10): the save's
    `.tmp-step_10` is left behind unfinished, step_5 stays the newest complete checkpoint, and the
    restart resumes from it and redoes steps 6-10; the rewritten step_10 and step_5 verify."""
    rank, inside = SAVE_KILLS[case]
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    tmp = run_dir / "checkpoints" / f".tmp-step_{STEPS}"
    mark = tmp / inside if inside else tmp
    job = _start(run_dir, tiny_data, log)
    try:
        workers = _wait_for(lambda: _both_workers(job), job, "workers", log, poll=0.05)
        _wait_for(mark.exists, job, f"{mark.name} in the save of step {STEPS}", log, poll=0.001)
        at_kill = _kill(job, workers[rank], run_dir, log)
    except BaseException:
        _stop(job)
        raise
    out = _finish(job, log)
    # the kill landed inside the save: the folder was never renamed into place
    assert tmp.name in at_kill["at_kill"] and f"step_{STEPS}" not in at_kill["at_kill"], at_kill
    assert at_kill["complete"] == [SAVE_EVERY], at_kill
    reached, resumed = _check_redone_steps(out, at_kill, run_dir, rank)
    assert (reached, resumed) == (STEPS, SAVE_EVERY)
    root = run_dir / "checkpoints"
    assert {p.name for p in root.iterdir()} == {"latest", f"step_{SAVE_EVERY}", f"step_{STEPS}"}
    assert verify(root / f"step_{STEPS}") is None and verify(root / f"step_{SAVE_EVERY}") is None
    ref = layout_run(LAYOUT)
    assert_close_losses(train_losses(ref), train_losses(run_dir), rtol=1e-4)
    assert_layout(run_dir, *LAYOUTS[LAYOUT])
    assert_close_updates(ref, run_dir, tol=1e-4)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str):
    """A real small disk: a tmpfs of `size` mounted at `where` (needs root), unmounted afterwards."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full disk); run the tests as root")
    if shutil.which("mount") is None:
        pytest.skip("needs the mount command to mount a small tmpfs (a real full disk)")
    where.mkdir(parents=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    if refused.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused ({refused.stderr.strip()}): no real full disk to test on")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)  # still busy: detach


# 32-wide: a checkpoint (model + AdamW state, 2 ranks) takes about 0.9 MB of the 2 MB disk
DISK_MODEL = [o for o in TINY_MODEL if not o.startswith("model.hidden_size=")] + ["model.hidden_size=32"]
# bytes of other data on the disk, so that step_5 fits and step_10 does not, and where it runs out:
FULL_DISKS = {
    # about 0.6 MB left after step_5: the two ranks' DCP data files do not fit
    "in-the-dcp-writes": 500_000,
    # about 16 kB left: the rank-local small files (RNG states, trainer state, config) do not fit
    "in-the-rank-local-files": 1_095_000,
}


@pytest.mark.slow
@pytest.mark.parametrize("where", FULL_DISKS)
def test_a_real_full_disk_during_a_save_keeps_the_previous_checkpoint(where, tiny_data, tmp_path):
    """Needs root: mounts a 2 MB tmpfs (skips, saying why, where mounting is refused) holding the run
    folder and a file of other data. The step-5 checkpoint fits; the step-10 save of the two ranks
    runs out of space for real (nothing injected), inside DCP's writes or in a rank's own small files:
    one error line, exit 1, no traceback from any rank, step_5 intact (verifies, loads, `latest` names
    it), no `.tmp-step_10` left. With the other file deleted, the same command resumes from step 5
    and redoes steps 6-10 with the losses of the failed attempt."""
    with _tmpfs(tmp_path / "disk", "2m") as disk:
        filler = disk / "other-data"
        filler.write_bytes(b"\0" * FULL_DISKS[where])
        run_dir = disk / "run"
        args = [
            "pretrain",
            *DISK_MODEL,
            f"data.path={tiny_data}",
            f"run.dir={run_dir}",
            *COMMON,
            "train.save_grads_step=0",  # the free space is sized for checkpoints and metrics only
            f"train.max_steps={STEPS}",
            "parallel.dp=2",
            "launch.nproc_per_node=2",
        ]
        full = run_suite(*args, timeout=420)
        out = full.stdout + full.stderr
        assert full.returncode == 1, out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in out, out
        root = run_dir / "checkpoints"
        failed_in = re.findall(
            rf"could not write the checkpoint of step {STEPS} to (\S+): No space left", out
        )
        assert len(failed_in) == 1 and "injected" not in errors[0], errors[0]
        small_file = re.fullmatch(
            r"(rng_rank\d+\.pt|trainer_state\.pt|config\.yaml)", Path(failed_in[0]).name
        )
        if where == "in-the-rank-local-files":
            assert small_file and Path(failed_in[0]).parent == root / f".tmp-step_{STEPS}", errors[0]
        else:
            assert not small_file and failed_in[0].startswith(str(root / f".tmp-step_{STEPS}")), errors[0]
        assert f"last good checkpoint: {root / f'step_{SAVE_EVERY}'}" in errors[0], errors[0]
        assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{SAVE_EVERY}"]
        assert (root / "latest").read_text().strip() == f"step_{SAVE_EVERY}"
        assert verify(root / f"step_{SAVE_EVERY}") is None
        weights = final_weights(run_dir)  # loads step_5
        assert all(torch.isfinite(w).all() for w in weights.values())
        failed = train_losses(run_dir)  # the failed attempt logged every step before its save failed
        assert sorted(failed) == list(range(1, STEPS + 1))

        filler.unlink()  # space freed
        again = run_suite(*args, timeout=420, check=True)
        assert f"resumed from {root / f'step_{SAVE_EVERY}'} at step {SAVE_EVERY}" in again.stdout, (
            again.stdout
        )
        assert_close_losses(failed, train_losses(run_dir), rtol=1e-4)
        assert verify(root / f"step_{STEPS}") is None


def test_a_full_disk_inside_dcp_writes_is_an_os_error_naming_the_file(tmp_path):
    """Needs root (a 64 kB tmpfs). DCP writes tensors with torch.save, whose C++ writer turns the
    ENOSPC of Python's write into a bare RuntimeError ('unexpected pos'); the suite's writer raises
    the OSError behind it, so the trainer recognises the full disk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from suite.train.checkpoint import _Writer
    from suite.train.saver import os_error_in

    with _tmpfs(tmp_path / "disk", "64k") as disk, pytest.raises(CheckpointException) as failed:
        dcp.save({"w": torch.zeros(100_000)}, storage_writer=_Writer(disk / "ckpt", 3))
    err = os_error_in(failed.value)
    assert err is not None and err.errno == errno.ENOSPC, failed.value
    assert err.filename == str(disk / "ckpt" / "__0_0.distcp")
