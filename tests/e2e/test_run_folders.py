"""Run folders that never mix two runs, checkpoints verified whatever folder names them, and cluster
recipes that stop in seconds: the CLI in a subprocess, as a user meets it (issue 16)."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import run_suite
from tests.suggested_fix import ways_on

# gpt-tiny as the recipe has it (4 layers), shrunk in data and steps only
FAST = [
    "train.max_steps=2",
    "train.save_every=1",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_batches=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=2",
    "data.seq_len=32",
    "train.precision=fp32",
    "log.wandb=false",
    "log.progress=false",
]


def pretrain(run_dir: Path, data: Path, *extra: str, timeout: float = 300):
    return run_suite("pretrain", f"data.path={data}", f"run.dir={run_dir}", *FAST, *extra, timeout=timeout)


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file and folder under `folder`: (sha256, size, mtime_ns); folders: their mtime."""
    out = {}
    for path in sorted(folder.rglob("*")):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(folder))] = (digest, stat.st_size, stat.st_mtime_ns)
    out["."] = ("dir", 0, folder.stat().st_mtime_ns)
    return out


def assert_one_line(proc, code: int = 2, *expected: str) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_data) -> Path:
    """`suite pretrain` of gpt-tiny for two steps (a checkpoint at each)."""
    run_dir = tmp_path_factory.mktemp("runs") / "gpt-tiny"
    proc = pretrain(run_dir, tiny_data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def test_checkpoints_record_what_must_match(base_run):
    found = json.loads((base_run / "checkpoints" / "step_2" / "fingerprint.json").read_text())
    assert found["model.num_layers"] == 4 and found["verb"] == "pretrain" and len(found["tokenizer"]) == 64
    assert not any(key.startswith("parallel.") for key in found)  # resuming across layouts is fine
    listed = json.loads((base_run / "checkpoints" / "step_2" / "manifest.json").read_text())["files"]
    assert "fingerprint.json" in listed


def test_resume_with_a_changed_model_refuses_and_writes_nothing(base_run, tiny_data):
    before = snapshot(base_run)
    refused = ["pretrain", f"data.path={tiny_data}", f"run.dir={base_run}", *FAST, "model.num_layers=2"]
    refused.append("train.max_steps=4")
    proc = run_suite(*refused)
    expected = "model.num_layers: checkpoint 4, now 2"
    line = assert_one_line(proc, 2, expected, "run.dir=", f"model.init_from={base_run}")
    assert "resumed" not in proc.stdout, line
    assert snapshot(base_run) == before  # byte for byte, mtimes included: nothing new, nothing rewritten

    # the way on that starts from those weights, run as printed (tests/suggested_fix.py): a new folder,
    # their architecture (model.num_layers=2 dropped: typed with model.init_from it conflicts)
    *_, from_weights = ways_on(line)
    assert from_weights.drops == ["model.num_layers"], line
    proc = run_suite(*from_weights.apply(refused))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model.init_from='{base_run}': step 2 (" in proc.stdout and "resumed" not in proc.stdout
    (new,) = [Path(a.split("=", 1)[1]) for a in from_weights.args if a.startswith("run.dir=")]
    latest = new / "checkpoints" / (new / "checkpoints" / "latest").read_text().strip()
    assert (
        latest.name == "step_4"
        and json.loads((latest / "fingerprint.json").read_text())["model.num_layers"] == 4
    )
    assert snapshot(base_run) == before


def test_resume_with_another_tokenizer_refuses(base_run, tmp_path):
    from suite.config.schema import DataConfig, DataSourceConfig
    from suite.data import prepare
    from tests.conftest import write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "text", num_docs=120)
    other = prepare(
        DataConfig(sources=[DataSourceConfig(path=str(corpus))], vocab_size=400, val_fraction=0.05),
        tmp_path / "other",
        progress=False,
    )
    before = snapshot(base_run)
    proc = pretrain(base_run, other, "train.max_steps=4")
    assert_one_line(proc, 2, "tokenizer")
    assert snapshot(base_run) == before


def test_resume_false_refuses_then_overwrite_moves_the_old_run_aside(base_run, tiny_data, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(base_run, run_dir)
    before = snapshot(run_dir)
    proc = pretrain(run_dir, tiny_data, "train.resume=false")
    assert_one_line(proc, 2, "train.resume=false", "train.overwrite=true", "run.dir=")
    assert snapshot(run_dir) == before

    proc = pretrain(run_dir, tiny_data, "train.resume=false", "train.overwrite=true", "train.max_steps=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    moved = tmp_path / "copy.old-1"
    assert f"moved the previous run in {run_dir} to {moved}" in proc.stdout
    assert "resumed" not in proc.stdout
    moved_files = {k: v for k, v in snapshot(moved).items() if k != "."}
    assert moved_files == {k: v for k, v in before.items() if k != "."}  # the old run, whole
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_1"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_1"


def test_every_checkpoint_reader_names_the_step_and_verifies_a_step_folder(base_run, tmp_path):
    step_1 = base_run / "checkpoints" / "step_1"
    for ckpt, step in ((base_run, 2), (step_1, 1)):
        proc = run_suite("generate", f"ckpt={ckpt}", "prompt=The ", "generate.max_new_tokens=2", "--json")
        assert proc.returncode == 0, proc.stderr
        assert f": step {step} (" in proc.stderr and "verified" in proc.stderr, proc.stderr
        json.loads(proc.stdout)  # stdout stays the result alone

    from suite.train.checkpoint import find_checkpoint

    assert find_checkpoint(base_run / "checkpoints") == (base_run / "checkpoints" / "step_2", [])

    corrupt = tmp_path / "run"
    shutil.copytree(base_run, corrupt)
    (corrupt / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"not a checkpoint")
    folder = corrupt / "checkpoints" / "step_1"
    proc = run_suite("export", f"ckpt={folder}", f"out={tmp_path / 'hf'}")
    assert_one_line(proc, 2, f"ckpt='{folder}'", "does not verify", "trainer_state.pt")
    assert not (tmp_path / "hf").exists()

    # a run folder whose newest checkpoint is corrupt: the older one is read, and the skip is said once
    (corrupt / "checkpoints" / "step_2" / "trainer_state.pt").write_bytes(b"broken")
    shutil.rmtree(corrupt / "checkpoints" / "step_1")
    shutil.copytree(step_1, corrupt / "checkpoints" / "step_1")
    proc = run_suite("export", f"ckpt={corrupt}", f"out={tmp_path / 'hf2'}")
    assert proc.returncode == 0, proc.stderr
    assert ": step 1 (" in proc.stderr and proc.stderr.count("skipping checkpoint step_2") == 1, proc.stderr
    weights = tmp_path / "hf2" / "model.safetensors"
    assert weights.stat().st_mode & 0o777 == (tmp_path / "hf2" / "config.json").stat().st_mode & 0o777


def test_a_run_folder_whose_checkpoints_all_fail_verification_refuses(base_run, tiny_data, tmp_path):
    """Resuming where no checkpoint verifies would start at step 0 and write over them: one line naming
    each broken step, nothing written; train.overwrite=true moves them aside and starts clean."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    for step in (1, 2):
        (run_dir / "checkpoints" / f"step_{step}" / "trainer_state.pt").write_bytes(b"broken")
    before = snapshot(run_dir)
    proc = pretrain(run_dir, tiny_data, "train.max_steps=3")
    assert_one_line(
        proc, 2, f"run.dir={run_dir}", "none verifies", "step_2", "step_1", "train.overwrite=true"
    )
    assert snapshot(run_dir) == before
    proc = pretrain(run_dir, tiny_data, "train.overwrite=true")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run.old-1" / "checkpoints" / "step_2" / "trainer_state.pt").read_bytes() == b"broken"


def test_a_cluster_recipe_stops_in_seconds_naming_what_it_needs(tmp_path):
    start = time.monotonic()
    proc = run_suite(
        "pretrain", "recipe=gpt13b", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, timeout=60
    )
    elapsed = time.monotonic() - start
    line = assert_one_line(
        proc, 2, "world size 32", "launch.nnodes=4", "launch.nproc_per_node=8", "this machine has"
    )
    assert elapsed < 30, (elapsed, line)
    assert not (tmp_path / "cache").exists()  # no tokenizer was trained first
    assert not (tmp_path / "runs").exists()  # and no run folder was made


def test_a_model_that_cannot_fit_one_process_stops_before_allocating(tmp_path):
    start = time.monotonic()
    proc = run_suite(
        "pretrain",
        "recipe=gpt13b",
        "launch.nnodes=1",
        "launch.nproc_per_node=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.sp=false",
        f"data.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=60,
    )
    line = assert_one_line(
        proc,
        2,
        "12.85B parameters as mb1-full",
        "GiB per process",
        "it needs at least",
        "suite plan recipe=gpt13b",
    )
    assert time.monotonic() - start < 30, line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_gpt175b_here_names_the_smallest_cluster_the_planner_would_need(tmp_path):
    """The planner's memory for the recipe's own layout against this machine's RAM: one line with
    the cluster (of the cluster group) it needs and the `suite plan` line for the table."""
    start = time.monotonic()
    proc = run_suite(
        "pretrain", "recipe=gpt175b", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, timeout=60
    )
    elapsed = time.monotonic() - start
    line = assert_one_line(
        proc,
        2,
        "world size 512",
        "sh4z1-tp8sp-pp16-mb1-full",
        "GiB per process",
        "it needs at least 1024 x cpu (cluster=cpu cluster.nodes=512",
        "`suite plan recipe=gpt175b cluster=cpu cluster.nodes=512` for the table",
    )
    assert elapsed < 30, (elapsed, line)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "change, expected",
    [
        ("optim.lr=-1", "optim.lr"),
        ("model.vocab_size=100", "model.vocab_size"),
    ],  # the parent's, the trainer's
)
def test_failed_validation_leaves_no_run_folder(tmp_path, tiny_data, change, expected):
    run_dir = tmp_path / "runs" / "never"
    proc = pretrain(run_dir, tiny_data, change)
    assert_one_line(proc, 2, expected)
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_without_a_fingerprint_is_compared_by_its_config(base_run, tiny_data, tmp_path):
    """Checkpoints written before fingerprints existed: their config.yaml tells the architecture."""
    from suite.train.checkpoint import write_manifest

    run_dir = tmp_path / "old"
    shutil.copytree(base_run, run_dir)
    for step in (1, 2):
        folder = run_dir / "checkpoints" / f"step_{step}"
        (folder / "fingerprint.json").unlink()
        write_manifest(folder, step)
    before = snapshot(run_dir)
    proc = pretrain(run_dir, tiny_data, "model.num_layers=2", "train.max_steps=4")
    assert_one_line(proc, 2, "model.num_layers: checkpoint 4, now 2")
    assert snapshot(run_dir) == before


def test_finetune_resume_with_another_method_refuses(base_run, tmp_path):
    run_dir = tmp_path / "sft"
    args = [
        "finetune",
        f"model.init_from={base_run}",
        f"run.dir={run_dir}",
        "finetune.data.num_train=64",
        "finetune.data.num_eval=8",
        "finetune.eval_samples=0",
        "data.seq_len=64",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        "train.max_steps=1",
        "train.eval_batches=1",
        "train.precision=fp32",
        "log.wandb=false",
        "log.progress=false",
    ]
    first = run_suite(*args, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"model.init_from='{base_run}': step 2 (" in first.stdout
    before = snapshot(run_dir)
    proc = run_suite(*args, "finetune.method=lora", "train.max_steps=2", timeout=300)
    assert_one_line(proc, 2, "finetune.method: checkpoint full, now lora")
    assert snapshot(run_dir) == before


def test_a_node_waiting_for_its_peers_says_so(tmp_path, tiny_data):
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO, free_port, suite_env

    port = free_port()
    fast = [a for a in FAST if not a.startswith("parallel.global_batch_size=")]
    args = ["pretrain", f"data.path={tiny_data}", f"run.dir={tmp_path / 'run'}", *fast]
    args += [
        "parallel.dp=2",
        "launch.nnodes=2",
        "launch.node_rank=0",
        f"launch.rdzv_endpoint=127.0.0.1:{port}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", *args],
        cwd=REPO,
        env=suite_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        line, seen = "", []
        while time.monotonic() < deadline and "waiting" not in line:
            line = proc.stdout.readline()
            seen.append(line)
            if not line:
                break  # the node ended instead of waiting
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert "node 0 of 2: waiting" in line and f"launch.rdzv_endpoint=127.0.0.1:{port}" in line, seen
    assert "launch.node_rank=<n>" in line and "start node(s) 1" in line, line


def test_an_architecture_key_typed_with_init_from_conflicts(base_run, tiny_data, tmp_path):
    """Why the refusal above says to drop model.num_layers= when it suggests model.init_from."""
    proc = pretrain(tmp_path / "other", tiny_data, f"model.init_from={base_run}", "model.num_layers=2")
    assert_one_line(proc, 2, "model.num_layers=2 conflicts with model.init_from=", "is 4")
    assert not (tmp_path / "other").exists()


def test_overwrite_never_moves_the_weights_it_starts_from(base_run, tiny_data):
    before = snapshot(base_run)
    proc = pretrain(base_run, tiny_data, f"model.init_from={base_run}", "train.overwrite=true")
    assert_one_line(proc, 2, "train.overwrite=true", "run.dir=")
    assert snapshot(base_run) == before


def test_cuda_asked_for_on_a_machine_without_one_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_suite("pretrain", "train.device=cuda", f"run.dir={tmp_path / 'run'}", timeout=60)
    assert_one_line(proc, 2, "train.device=cuda", "no CUDA device", "train.device=auto")
    assert not (tmp_path / "run").exists()
