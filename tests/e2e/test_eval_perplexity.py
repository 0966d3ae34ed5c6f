"""`suite eval metric=perplexity` as a user types it: the figure of an exported HF folder equals what
transformers computes with the loop of Hugging Face's perplexity guide on the same tokens and
windows (gpt-tiny and llama-tiny shapes), the suite checkpoint gives the same figure as its export,
and the window logic is checked against a token-by-token hand computation."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import SENTENCES
from tests.forked_cli import ForkedCLI
from tests.helpers import TINY_MODEL, run_suite, suite_env

FAMILIES = {
    "gpt": ["model=gpt-tiny", *TINY_MODEL],
    "llama": [
        "model=llama-tiny",
        *TINY_MODEL,
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=128",
    ],
}


@pytest.fixture(scope="module")
def forked():
    cli = ForkedCLI(suite_env())
    yield cli
    cli.close()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl_text") / "text.txt"
    path.write_text(" ".join(SENTENCES[(i * 3) % len(SENTENCES)] for i in range(14)) + "\n")
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory, tiny_data):
    """A tiny run of the family (3 steps) and its `suite export` HF folder."""
    root = tmp_path_factory.mktemp(f"ppl_{request.param}")
    run, hf = root / "run", root / "hf"
    run_suite(
        "pretrain",
        *FAMILIES[request.param],
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "train.max_steps=3",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        check=True,
        timeout=300,
    )
    run_suite("export", f"ckpt={run}", f"out={hf}", check=True, timeout=300)
    return {"family": request.param, "run": run, "hf": hf, "data": tiny_data}


def _eval(forked, tmp_path, *args: str) -> dict:
    proc = forked.run(["eval", "metric=perplexity", *args, "--json"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def guide_perplexity(folder, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The loop of Hugging Face's perplexity guide (transformers AutoModelForCausalLM, labels with
    -100 before each window's new tokens), each window's mean loss weighted by the number of
    tokens transformers actually scored in it (its labels after the one-token shift)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq_len = ids.size(0)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[begin_loc:end_loc][None]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(loss) * scored
        n_tokens += scored
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return float(torch.exp(torch.tensor(nll_sum / n_tokens, dtype=torch.float64))), n_tokens


def _close(a: float, b: float) -> bool:
    """Equal to 4 significant digits (relative 5e-5)."""
    return abs(a - b) <= 5e-5 * abs(b)


@pytest.mark.parametrize(("seq_len", "stride"), [(None, None), (32, 8)])
def test_hf_export_matches_transformers(forked, model, text_file, tmp_path, seq_len, stride):
    from transformers import AutoTokenizer

    args = [f"ckpt=hf:{model['hf']}", f"eval.data={text_file}", "eval.batch_size=3"]
    args += [f"eval.seq_len={seq_len}", f"eval.stride={stride}"] if seq_len else []
    got = _eval(forked, tmp_path, *args)
    ids = AutoTokenizer.from_pretrained(model["hf"]).encode(text_file.read_text(), add_special_tokens=False)
    ids = torch.tensor(ids)
    assert ids.numel() > 2 * 64, "the text must need several windows"
    want, count = guide_perplexity(model["hf"], ids, seq_len or 64, stride or seq_len or 64)
    assert got["tokens"] == count and got["seq_len"] == (seq_len or 64) and got["stride"] == (stride or 64)
    assert _close(got["perplexity"], want), (got["perplexity"], want)
    if stride:  # overlapping windows: every token after the first scored exactly once
        assert got["tokens"] == ids.numel() - 1
    # the suite checkpoint the export came from: the same figure
    assert _close(_eval(forked, tmp_path, f"ckpt={model['run']}", *args[1:])["perplexity"], want)


def test_validation_shards_by_default(forked, model, tmp_path):
    """No eval.data: the run's validation shard; its HF export reads the same tokens given data.path."""
    from suite.data import IndexedTokens

    window = ["eval.max_tokens=300", "eval.stride=32"]  # overlapping windows: all 300 tokens scored
    run = _eval(forked, tmp_path, f"ckpt={model['run']}", *window)
    assert run["data"].endswith("/val") and run["tokens"] == 300
    assert IndexedTokens(model["data"] / "val").num_tokens > 300
    hf = _eval(forked, tmp_path, f"ckpt=hf:{model['hf']}", f"data.path={model['data']}", *window)
    assert _close(hf["perplexity"], run["perplexity"]) and hf["tokens"] == 300
    proc = forked.run(["eval", f"ckpt=hf:{model['hf']}", "metric=perplexity"], cwd=tmp_path)
    assert proc.returncode == 2 and "is an HF folder, so there are no run validation shards" in proc.stderr


def test_human_output_is_a_table(forked, model, text_file, tmp_path):
    proc = forked.run(
        ["eval", f"ckpt={model['run']}", "metric=perplexity", f"eval.data={text_file}"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["perplexity", "loss", "tokens", "windows", "data", "ckpt"]
    assert "step 3" in proc.stderr  # which checkpoint was read
