"""The launcher: impossible layouts stop before any process starts, two loopback "nodes" train
together, and a dying worker ends the job with one error line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from suite.cli import main as cli_main
from suite.launch.launcher import rendezvous_endpoint
from tests.distributed.conftest import COMMON
from tests.helpers import (
    REPO,
    TINY_MODEL,
    assert_equivalent,
    assert_layout,
    child_processes,
    fork_servers,
    process_gone,
    run_loopback_nodes,
    run_suite,
    suite_env,
    worker_pids,
)

# (overrides, words the one-line error must contain)
BAD_LAYOUTS = [
    (["parallel.tp=3", "launch.nproc_per_node=2"], ["multiply to 3", "world size"]),
    (["parallel.tp=8", "launch.nproc_per_node=8"], ["parallel.tp=8", "num_heads=4"]),
    (["parallel.tp=2", "model.num_kv_heads=1", "launch.nproc_per_node=2"], ["num_kv_heads=1"]),
    (["parallel.pp=4", "launch.nproc_per_node=4"], ["exceed model.num_layers=2"]),
    (
        [
            "parallel.dp=2",
            "parallel.global_batch_size=6",
            "parallel.micro_batch_size=4",
            "launch.nproc_per_node=2",
        ],
        ["global_batch_size=6"],
    ),
    (["parallel.sp=true"], ["parallel.sp=true needs parallel.tp > 1"]),
    (["parallel.sharding=2", "parallel.sharding_stage=4", "launch.nproc_per_node=2"], ["sharding_stage=4"]),
    (
        [
            "parallel.sharding=2",
            "parallel.sharding_stage=1",
            "parallel.offload=true",
            "launch.nproc_per_node=2",
        ],
        ["parallel.offload=true", "stage 2 or 3"],
    ),
    (["parallel.dp=2", "parallel.offload=true", "launch.nproc_per_node=2"], ["parallel.offload=true"]),
    (["parallel.dp=auto", "parallel.sharding=auto", "launch.nproc_per_node=2"], ["at most one degree"]),
    (["parallel.cp=3", "launch.nproc_per_node=3"], ["parallel.cp=3", "data.seq_len=32", "multiple of 6"]),
    (
        ["parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "data.seq_len=36", "launch.nproc_per_node=8"],
        ["parallel.sp=true", "18", "multiple of 16"],
    ),
    (["parallel.ep=2", "parallel.dp=2", "launch.nproc_per_node=2"], ["parallel.ep=2"]),
    (["parallel.ep_dispatch=ring"], ["parallel.ep_dispatch='ring'", "flat, hierarchical, auto"]),
    (  # ep groups (0,1) (2,3) (4,5) on 2 nodes x 3 processes: the middle one straddles the nodes
        [
            "recipe=moe-tiny",
            "parallel.dp=6",
            "parallel.ep=2",
            "parallel.global_batch_size=24",
            "parallel.micro_batch_size=4",
            "parallel.ep_dispatch=hierarchical",
            "launch.nnodes=2",
            "launch.nproc_per_node=3",
        ],
        ["parallel.ep_dispatch=hierarchical", "parallel.ep_dispatch=flat or auto"],
    ),
    (["parallel.tp=2", "model.vocab_size=511", "launch.nproc_per_node=2"], ["model.vocab_size=511"]),
    (["parallel.tp=2", "model.ffn_hidden_size=255", "launch.nproc_per_node=2"], ["ffn_hidden_size", "255"]),
    (
        ["parallel.tp=2", "parallel.sp=true", "data.seq_len=31", "launch.nproc_per_node=2"],
        ["data.seq_len=31"],
    ),
    (["parallel.vpp=2", "launch.nproc_per_node=1"], ["parallel.vpp=2 needs parallel.pp > 1"]),
    (
        ["parallel.dp=2", "launch.nnodes=2", "launch.node_rank=2", "launch.nproc_per_node=1"],
        ["launch.node_rank=2"],
    ),
    (["parallel.dp=2", "launch.backend=nccl", "train.device=cpu", "launch.nproc_per_node=2"], ["nccl"]),
]


@pytest.mark.parametrize("overrides,words", BAD_LAYOUTS, ids=[" ".join(o[:2]) for o, _ in BAD_LAYOUTS])
def test_impossible_layout_is_one_line_before_launch(overrides, words, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli_main(["pretrain", *TINY_MODEL, f"data.path={tiny_data}", f"run.dir={run_dir}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, (word, err)
    assert not run_dir.exists()  # nothing was launched, nothing written


def test_impossible_layout_exits_2_from_the_shell(tiny_data, tmp_path):
    proc = run_suite(
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={tmp_path / 'run'}",
        "parallel.tp=3",
        "launch.nproc_per_node=2",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: parallel degrees tp=3")
    assert not (tmp_path / "run").exists()


def test_one_node_default_endpoint_gets_a_free_port():
    from suite.config.schema import LaunchConfig

    assert rendezvous_endpoint(LaunchConfig(nproc_per_node=2)) == "127.0.0.1:0"
    assert rendezvous_endpoint(LaunchConfig(nnodes=2, rdzv_endpoint="10.0.0.1:29400")) == "10.0.0.1:29400"
    assert (
        rendezvous_endpoint(LaunchConfig(nproc_per_node=2, rdzv_endpoint="127.0.0.1:4242"))
        == "127.0.0.1:4242"
    )


def _popen(args: list[str], log: Path) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "suite", *args],
        cwd=REPO,
        env=suite_env(),
        stdout=handle,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_two_loopback_nodes_train_like_one_process(layout_run, tiny_data, tmp_path):
    """Two `suite pretrain ... launch.nnodes=2 launch.node_rank=0/1` commands, as on two machines."""
    run_dir = tmp_path / "two-nodes"
    args = [
        "pretrain",
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run_dir}",
        *COMMON,
        "train.max_steps=10",
        "parallel.dp=2",
        "launch.nproc_per_node=1",
    ]
    run_loopback_nodes(args, tmp_path)
    assert_layout(run_dir, 2, ["parallel.dp=2"])  # one process on each of the two "nodes"
    assert_equivalent(layout_run("single"), run_dir)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
@pytest.mark.parametrize("worker_start", ["fork", "spawn"])
def test_a_dying_worker_ends_the_job_with_one_error_line(tiny_data, tmp_path, worker_start):
    """SIGKILL to rank 1's process, as the OOM killer would. Under `fork` that process is the client
    of a worker forked by the job's server (suite/launch/fork_server.py): the test asserts that process
    tree, and that the client's death takes the forked worker with it."""
    run_dir = tmp_path / "dies"
    log = tmp_path / "job.log"
    job = _popen(
        [
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
            f"launch.worker_start={worker_start}",
        ],
        log,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and '"loss"' in metrics.read_text():
                break
            time.sleep(0.5)
        workers = worker_pids(job.pid)
        assert sorted(workers) == [0, 1], (workers, log.read_text())
        servers = fork_servers(job.pid)
        forked = child_processes(servers[0]) if servers else {}
        if worker_start == "fork":
            assert len(servers) == 1 and len(forked) == 2, (servers, forked)
        else:
            assert servers == [], servers
        os.kill(workers[1], signal.SIGKILL)  # as the OOM killer would
        code = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code != 0, out
    assert errors == [errors[0]] and "rank 1" in errors[0] and "SIGKILL" in errors[0], out
    deadline = time.time() + 30
    while time.time() < deadline and not all(process_gone(pid) for pid in [*forked, *servers]):
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in [*forked, *servers]), (
        "forked workers or their server outlived the job"
    )
