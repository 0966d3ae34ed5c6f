"""The real CLI as a user types it, asserting on exit codes, messages and the files it writes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TINY_MODEL, read_metrics, run_suite, suite_env

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb"}


def pretrain_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [
        "pretrain",
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        "train.max_steps=20",
        "train.save_every=10",
        "train.log_every=5",
        "train.eval_every=10",
        "train.eval_batches=2",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        "optim.lr=3e-3",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_data) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    run_suite(*pretrain_args(run_dir, tiny_data), check=True)
    return run_dir


def test_pretrain_writes_the_run_folder(trained_run):
    assert (trained_run / "config.yaml").is_file()
    assert (trained_run / "tokenizer.json").is_file()
    assert (trained_run / "checkpoints" / "step_10" / "manifest.json").is_file()
    assert (trained_run / "checkpoints" / "step_20" / "config.yaml").is_file()
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_20"
    records = read_metrics(trained_run)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [5, 10, 15, 20]
    assert all(r.keys() >= METRIC_KEYS for r in train_records)
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    summary = json.loads((trained_run / "summary.json").read_text())
    assert summary["step"] == 20


def test_generate_prints_text(trained_run):
    proc = run_suite(
        "generate", f"ckpt={trained_run}", "prompt=The module", "generate.max_new_tokens=12", check=True
    )
    assert proc.stdout.startswith("The module") and len(proc.stdout.strip()) > len("The module")
    greedy = run_suite(
        "generate",
        f"ckpt={trained_run}",
        "prompt=The module",
        "generate.temperature=0",
        "generate.max_new_tokens=8",
        "--json",
        check=True,
    )
    again = run_suite(
        "generate",
        f"ckpt={trained_run / 'checkpoints' / 'step_20'}",
        "prompt=The module",
        "generate.temperature=0",
        "generate.max_new_tokens=8",
        "--json",
        check=True,
    )
    assert json.loads(greedy.stdout)["text"] == json.loads(again.stdout)["text"]


def test_export_loads_in_transformers_and_generates_alike(trained_run, tmp_path):
    out = tmp_path / "hf"
    run_suite("export", f"ckpt={trained_run}", "format=hf", f"out={out}", check=True)
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); t = AutoTokenizer.from_pretrained({str(out)!r});"
        "ids = t('The module', return_tensors='pt').input_ids;"
        "g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False);"
        "print(t.decode(g[0, ids.shape[1]:]))"
    )
    hf_text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    ours = run_suite(
        "generate",
        f"ckpt={trained_run}",
        "prompt=The module",
        "generate.temperature=0",
        "generate.max_new_tokens=8",
        "--json",
        check=True,
    )
    from_hf = run_suite(
        "generate",
        f"ckpt=hf:{out}",
        "prompt=The module",
        "generate.temperature=0",
        "generate.max_new_tokens=8",
        "--json",
        check=True,
    )
    assert json.loads(ours.stdout)["text"] == json.loads(from_hf.stdout)["text"] == hf_text.rstrip("\n")


def test_killed_run_resumes_bitwise(tmp_path, tiny_data, trained_run):
    """SIGKILL after the step-10 checkpoint, run the same command again: same final loss, bitwise."""
    run_dir = tmp_path / "killed"
    args = pretrain_args(run_dir, tiny_data, "train.max_steps=20")
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite", *args],
        cwd=REPO,
        env=suite_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = run_dir / "checkpoints" / "step_10" / "manifest.json"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    assert not (run_dir / "checkpoints" / "step_20").exists(), "the run finished before it could be killed"
    resumed = run_suite(*args, check=True)
    assert "resumed from" in resumed.stdout
    final = [r for r in read_metrics(run_dir) if r["step"] == 20][0]
    reference = [r for r in read_metrics(trained_run) if r["step"] == 20][0]
    assert final["loss"] == reference["loss"]
    assert final["val_loss"] == reference["val_loss"]


BAD_CLI_INPUTS = [
    (["pretrain", "recipe=gpt14b"], "not a known recipe"),
    (["pretrain", "model.num_layer=3"], "did you mean 'model.num_layers'"),
    (["pretrain", "train.max_steps=abc"], "train.max_steps"),
    (["pretrain", "parallel.tp=2"], "world size"),
    (["pretrain", "data.path=/does/not/exist"], "does not exist"),
    (["pretrain", "--fast"], "unknown flag"),
    (["frobnicate"], "unknown verb"),
    (["generate", "prompt=hi"], "ckpt is missing"),
    (["generate", "ckpt=/nowhere"], "neither a run folder"),
    (["config", "cp", "recipe=gpt99b", "/tmp/x.yaml"], "not a known recipe"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_CLI_INPUTS, ids=[" ".join(a) for a, _ in BAD_CLI_INPUTS])
def test_bad_input_exits_2_with_one_line(args, expected):
    proc = run_suite(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("verb", ["pretrain", "prepare", "generate", "export", "config"])
def test_every_verb_has_help(verb):
    proc = run_suite(verb, "--help", check=True)
    assert proc.stdout.startswith("usage: suite")


def test_config_show_list_and_cp(tmp_path):
    shown = run_suite("config", "show", "recipe=gpt13b", check=True).stdout
    assert "hidden_size: 5120" in shown and "num_layers: 40" in shown
    listed = run_suite("config", "list", "--json", check=True).stdout
    assert "gpt175b" in json.loads(listed)["recipe"]
    dest = tmp_path / "my13b.yaml"
    run_suite("config", "cp", "recipe=gpt13b", str(dest), check=True)
    dest.write_text(dest.read_text().replace("max_steps: 300000", "max_steps: 5"))
    mine = run_suite("config", "show", f"recipe={dest}", "--json", check=True).stdout
    assert json.loads(mine)["train"]["max_steps"] == 5
    # a copy over the edited one is refused with a command that copies to a free name (my13b-1.yaml)
    refused = run_suite("config", "cp", "recipe=gpt13b", str(dest))
    assert refused.returncode == 2 and "max_steps: 5" in dest.read_text(), refused.stderr
    suggested = refused.stderr.split("`")[1].split()
    assert suggested[:4] == ["suite", "config", "cp", "recipe=gpt13b"], refused.stderr
    run_suite(*suggested[1:], check=True)
    assert (tmp_path / "my13b-1.yaml").is_file()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, tiny_data, precision):
    run_dir = tmp_path / precision
    args = pretrain_args(
        run_dir, tiny_data, "train.max_steps=10", f"train.precision={precision}", "sched.warmup_steps=1"
    )
    run_suite(*args, check=True)
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # finite, logged
    from suite.runtime import emulates_low_precision

    mfus = [r["mfu"] for r in read_metrics(run_dir) if "loss" in r]
    if emulates_low_precision(torch.device("cpu"), precision):  # no ceiling applies: none reported
        assert mfus == [None, None], mfus
    else:
        assert all(0 < m <= 1 for m in mfus), mfus
    val = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    assert val[10] < 0.8 * val[0], val  # it learns: 10 steps at lr 3e-3 take off over 20% (ln 512 = 6.24)


def test_wandb_runs_offline_without_a_key(tmp_path, tiny_data):
    run_dir = tmp_path / "wandb"
    env = suite_env()
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    args = [a for a in pretrain_args(run_dir, tiny_data, "train.max_steps=5") if a != "log.wandb=false"]
    run_suite(*args, "log.wandb=true", env=env, check=True)
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs, "wandb wrote no offline run"
