"""scripts/slurm/suite.sbatch: syntax, the per-node commands it builds from Slurm's environment (a dry
run with fake SLURM_* variables), that they match `suite pretrain ... --print-launch`, and a real
submission to a one-node Slurm started on this machine (skipped where slurm-wlm and munge are absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO, run_suite, suite_env

SCRIPT = REPO / "scripts" / "slurm" / "suite.sbatch"
ENDPOINT = "gpu01:29500"


def _dry_run(*args: str, **slurm: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in suite_env().items() if not k.startswith("SLURM_")}
    env.update({"SUITE_SLURM_DRY_RUN": "1", **slurm})
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_prints_one_command_per_node():
    proc = _dry_run(
        "pretrain",
        "recipe=gpt13b",
        "train.max_steps=10",
        SLURM_NNODES="4",
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_GPUS_ON_NODE="8",
    )
    assert proc.returncode == 0, proc.stderr
    expected = [
        "python -m suite pretrain recipe=gpt13b train.max_steps=10 launch.nnodes=4 "
        f"launch.nproc_per_node=8 launch.rdzv_endpoint={ENDPOINT} launch.node_rank={rank}"
        for rank in range(4)
    ]
    assert proc.stdout.splitlines() == expected


def test_dry_run_keeps_a_given_process_count_and_refuses_slurms_keys():
    proc = _dry_run(
        "finetune",
        "launch.nproc_per_node=2",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="a7,b3",
        SUITE_RDZV_PORT="6000",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"python -m suite finetune launch.nnodes=2 launch.nproc_per_node=2 launch.rdzv_endpoint=a7:6000 "
        f"launch.node_rank={r}"
        for r in (0, 1)
    ]
    refused = _dry_run("pretrain", "launch.node_rank=1", SLURM_NNODES="2", SLURM_JOB_NODELIST="a7,b3")
    assert refused.returncode == 2
    assert "launch.node_rank comes from Slurm" in refused.stderr
    unknown = _dry_run("pretrain", SLURM_NNODES="1", SLURM_JOB_NODELIST="a7")  # no GPU count: the recipe's
    assert unknown.stdout.split() == [
        "python",
        "-m",
        "suite",
        "pretrain",
        "launch.nnodes=1",
        "launch.rdzv_endpoint=a7:29500",
        "launch.node_rank=0",
    ]


def test_print_launch_matches_the_scripts_commands():
    args = ["pretrain", "recipe=gpt13b", "train.max_steps=10"]
    script = _dry_run(*args, SLURM_NNODES="4", SLURM_JOB_NODELIST="gpu[01-04]", SLURM_GPUS_ON_NODE="8")
    launch = ["launch.nnodes=4", "launch.nproc_per_node=8", f"launch.rdzv_endpoint={ENDPOINT}"]
    proc = run_suite(*args, *launch, "--print-launch", check=True)
    assert proc.stdout.splitlines() == script.stdout.splitlines()
    assert proc.stderr == ""  # a routable endpoint: no note


def test_print_launch_notes_a_loopback_endpoint():
    proc = run_suite("pretrain", "launch.nnodes=2", "--print-launch", check=True)
    assert [line.split()[-1] for line in proc.stdout.splitlines()] == [
        "launch.node_rank=0",
        "launch.node_rank=1",
    ]
    assert "loopback address" in proc.stderr and "launch.rdzv_endpoint=<node 0's address>" in proc.stderr


# --- a real Slurm: slurmctld + slurmd on this machine -------------------------------------------

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "munged", "scontrol")


def _missing_slurm() -> str:
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"needs slurm-wlm and munge (apt-get install slurm-wlm munge): {', '.join(missing)} not found"
    if os.geteuid() != 0:
        return "the one-node Slurm of this test runs its daemons as root"
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_missing_slurm()), reason=_missing_slurm() or "-")
def test_sbatch_runs_a_dp2_job_on_a_local_slurm(tmp_path, tiny_data):
    from tests.helpers import TINY_MODEL, read_metrics
    from tests.local_slurm import LocalSlurm

    run_dir = tmp_path / "run"
    args = [
        "pretrain",
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        *TINY_MODEL,
        "train.max_steps=3",
        "train.save_every=3",
        "train.log_every=1",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.compile=false",
        "parallel.dp=2",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=4",
        "launch.nproc_per_node=2",
    ]
    with LocalSlurm(tmp_path / "slurm") as slurm:
        proc = slurm.sbatch(SCRIPT, args, cwd=REPO, timeout=420)
    log = f"{slurm.job_output}\n{slurm.final_logs}"
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{log}"
    assert "rendezvous at localhost:" in log, log
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps and max(steps) == 3, log
    assert (run_dir / "checkpoints" / "step_3").is_dir(), log
