"""Speed tooling through the real CLI: the profiling switch and the chunked loss in a training run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY_MODEL, run_suite, suite_env, train_losses

BASE = [
    *TINY_MODEL,
    "train.max_steps=4",
    "train.save_every=100",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=1",
    "parallel.micro_batch_size=4",
    "parallel.global_batch_size=4",
]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, tiny_data) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("profile") / "run"
    args = [f"data.path={tiny_data}", f"run.dir={run_dir}", "train.profile=true"]
    proc = run_suite("pretrain", *BASE, *args, "train.profile_wait=1", "train.profile_warmup=1", check=True)
    return run_dir, proc.stdout


def test_profile_writes_a_chrome_trace_and_the_top_operators(profiled_run):
    run_dir, stdout = profiled_run
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)  # operators were recorded
    table = (run_dir / "profile" / "top_ops_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert "profile: top operators by self_cpu_time_total" in stdout
    assert len(train_losses(run_dir)) == 4  # profiling does not change the run


def test_profile_steps_must_be_positive(tmp_path, tiny_data):
    proc = run_suite(
        "pretrain", *BASE, f"data.path={tiny_data}", f"run.dir={tmp_path}", "train.profile_steps=0"
    )
    assert proc.returncode == 2
    assert "train.profile_steps=0" in proc.stderr and "Traceback" not in proc.stderr


def test_the_benchmark_harness_times_both_contenders_on_equal_terms(tmp_path):
    """`bench/throughput.py --quick`: both contenders train, the table is printed last, every row says
    what it ran (the peer: fused AdamW, the precision asked), and the figures are real measurements."""
    raw = tmp_path / "raw.json"
    out = subprocess.run(
        [
            sys.executable,
            "bench/throughput.py",
            "--quick",
            "--precision",
            "fp32",
            "--no-write",
            "--retries",  # a contended window is kept as it is: this checks the harness, not the figures
            "0",
            "--raw",
            str(raw),
        ],
        cwd=REPO,
        env=suite_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    header, *rows = [line for line in out.stdout.strip().splitlines() if line.startswith("| ")]
    assert out.stdout.strip().endswith(rows[-1]), out.stdout[-2000:]  # the table is the last thing printed
    columns = [c.strip() for c in header.strip("|").split("|")]
    table = {
        r["contender"]: r
        for r in (dict(zip(columns, [c.strip() for c in row.strip("|").split("|")])) for row in rows)
    }
    assert set(table) == {"suite", "transformers"}, out.stdout[-2000:]
    for row in table.values():
        assert row["shape"] == "gpt-tiny" and row["precision"] == "fp32", row
        assert "fp32 weights; fp32 compute" in row["setup"], row  # what was asked, not autocast or bf16
        assert float(row["tokens/s"].replace(",", "")) > 0, row
        assert 0 < float(row["MFU"].rstrip("%")) <= 100, row
    assert table["transformers"]["setup"].startswith("AdamW fused;"), table["transformers"]
    assert table["suite"]["suite / transformers"].endswith("x eager"), table["suite"]

    runs = {run["contender"]: run for run in json.loads(raw.read_text())["runs"]}
    assert set(runs) == {"suite", "hf"}
    assert runs["suite"]["info"]["flops_per_token"] == runs["hf"]["info"]["flops_per_token"]  # one formula
    for run in runs.values():
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] <= 1, run
        assert run["info"]["weights"] == "fp32" and run["info"]["compute"] == "fp32", run["info"]
        assert run["info"]["first_loss"] > 0 and run["windows"][0]["loss"] > 0  # both really trained
    assert runs["hf"]["info"]["optimizer"] == "AdamW fused"
