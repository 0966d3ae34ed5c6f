"""`suite eval harness=<task,...>`: the shipped task end to end through the CLI on a suite
checkpoint, and the bridge (SuiteLM) against lm_eval's own `hf` model on the HF export of the same
model: per-sample log-likelihoods within 1e-4 and equal scores; rolling log-likelihoods and greedy
generations too."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'suite[harness]'")

from tests.helpers import TINY_MODEL, run_suite  # noqa: E402

TASK = "suite_tiny_mc"


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_data):
    """A tiny llama-shaped run (3 steps) and its HF export."""
    root = tmp_path_factory.mktemp("harness")
    run, hf = root / "run", root / "hf"
    run_suite(
        "pretrain",
        "model=llama-tiny",
        *TINY_MODEL,
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=128",
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "train.max_steps=3",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        check=True,
        timeout=300,
    )
    run_suite("export", f"ckpt={run}", f"out={hf}", check=True, timeout=300)
    return {"run": run, "hf": hf}


def test_shipped_task_runs_through_the_cli(model, tmp_path):
    proc = run_suite("eval", f"ckpt={model['run']}", f"harness={TASK}", "--json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads(proc.stdout)
    scores = result["tasks"][TASK]
    assert scores["samples"] == 30
    for metric in ("acc", "acc_norm"):
        assert 0.0 <= scores[metric] <= 1.0 and scores[metric] * 30 == pytest.approx(
            round(scores[metric] * 30)
        )
        assert scores[f"{metric}_stderr"] > 0
    assert result["ckpt"].endswith("step_3")
    proc = run_suite(
        "eval", f"ckpt={model['run']}", f"harness={TASK}", "eval.limit=4", cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["task", "metric", "value", "stderr"]
    assert any(line.split()[:2] == [TASK, "acc"] and "(4 samples)" in line for line in lines), proc.stdout


def _per_sample(raw: dict) -> dict[tuple[int, int], float]:
    """{(doc_id, choice): log-likelihood} of lm_eval's logged samples."""
    out = {}
    for sample in raw["samples"][TASK]:
        for choice, resp in enumerate(sample["resps"]):
            out[sample["doc_id"], choice] = float(resp[0][0])
    return out


def test_bridge_matches_lm_eval_hf_model(model):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from suite.infer.harness import SuiteLM, evaluate_lm, scores, task_manager

    manager = task_manager()
    ours = SuiteLM(f"hf:{model['hf']}", device="cpu", batch_size=4)
    theirs = HFLM(pretrained=str(model["hf"]), device="cpu", dtype="float32", batch_size=4)
    raw_ours = evaluate_lm(ours, [TASK], None, manager, log_samples=True)
    raw_theirs = evaluate_lm(theirs, [TASK], None, manager, log_samples=True)
    a, b = _per_sample(raw_ours), _per_sample(raw_theirs)
    assert a.keys() == b.keys() and len(a) == 120
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst <= 1e-4, worst
    assert len({round(v, 3) for v in a.values()}) > 10  # real, different likelihoods
    got, want = scores(raw_ours)[TASK], scores(raw_theirs)[TASK]
    assert got["acc"] == want["acc"] and got["acc_norm"] == want["acc_norm"], (got, want)
    # the suite checkpoint the export came from: the same likelihoods
    run_lm = SuiteLM(str(model["run"]), device="cpu", batch_size=4)
    c = _per_sample(evaluate_lm(run_lm, [TASK], 6, manager, log_samples=True))
    assert max(abs(c[k] - a[k]) for k in c) <= 1e-4
    # rolling log-likelihood (longer than the context: several windows) and greedy generation
    text = "The optimizer updates the parameters using the computed gradients. " * 12
    rolling = [
        Instance("loglikelihood_rolling", {}, (text,), 0),
        Instance("loglikelihood_rolling", {}, ("Hi",), 1),
    ]
    assert len(ours.tok_encode(text)) > ours.max_length
    for x, y in zip(ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling), strict=True):
        assert abs(x - y) <= 1e-4 * max(1.0, abs(y)), (x, y)
    kwargs = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    gen = [Instance("generate_until", {}, ("Tensors are", dict(kwargs)), 0)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)
