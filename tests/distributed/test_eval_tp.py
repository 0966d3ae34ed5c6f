"""`suite eval metric=perplexity` under tensor parallelism (2 processes, gloo): the single-process
figure to 4 significant digits, from a suite checkpoint and from an hf: export, with rank 0 holding
a shard of the weights, not all of them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TINY_MODEL, run_suite


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("eval_tp")
    run, hf = root / "run", root / "hf"
    run_suite(
        "pretrain",
        "model=llama-tiny",
        *TINY_MODEL,
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=128",
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "train.max_steps=2",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        check=True,
        timeout=300,
    )
    run_suite("export", f"ckpt={run}", f"out={hf}", check=True, timeout=300)
    return {"run": run, "hf": hf}


@pytest.mark.parametrize("which", ["run", "hf"])
def test_tensor_parallel_perplexity_matches_one_process(model, tmp_path, which):
    ckpt = str(model["run"]) if which == "run" else f"hf:{model['hf']}"
    args = ["eval", f"ckpt={ckpt}", "metric=perplexity", "eval.seq_len=32", "eval.stride=16", "--json"]
    text = tmp_path / "text.txt"
    text.write_text("Each process in the group holds a shard of the model weights. " * 30)
    args.append(f"eval.data={text}")
    one = run_suite(*args, cwd=tmp_path, timeout=300)
    assert one.returncode == 0, one.stderr
    two = run_suite(*args, "launch.nproc_per_node=2", "parallel.tp=2", cwd=tmp_path, timeout=300)
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert b["tp"] == 2 and a["tokens"] == b["tokens"] and a["windows"] == b["windows"]
    assert abs(a["perplexity"] - b["perplexity"]) <= 5e-5 * a["perplexity"], (a, b)
    assert b["rank0_param_fraction"] < 0.75  # rank 0 holds a shard of the block matrices


def test_other_degrees_are_refused(model, tmp_path):
    proc = run_suite(
        "eval",
        f"ckpt={model['run']}",
        "metric=perplexity",
        "launch.nproc_per_node=2",
        "parallel.dp=2",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "tensor parallelism only" in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
