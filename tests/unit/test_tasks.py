"""Built-in SFT tasks: deterministic, disjoint splits, correct answers; evaluation plumbing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from suite.config.errors import ConfigError
from suite.data.chat import CHAT_TEMPLATES, normalize_record, prompt_ids
from suite.data.sft import SFTDataset, SFTOptions
from suite.data.tasks import DEFAULT_TASK, generate_task, get_task, list_tasks, score, write_task
from suite.train.loss import cross_entropy
from tests.unit.test_sft import make_tokenizer, tiny_model


def _addition_key(messages):
    a, b = messages[0]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
    return tuple(sorted((int(a), int(b))))


def test_addition_is_deterministic_with_disjoint_splits_and_right_answers():
    train, held_out = generate_task("addition-3", 3000, 300, seed=5)
    again_train, again_eval = generate_task("addition-3", 3000, 300, seed=5)
    assert train == again_train and held_out == again_eval
    assert len(train) == 3000 and len(held_out) == 300
    assert generate_task("addition-3", 3000, 300, seed=6)[1] != held_out
    train_keys = {_addition_key(m) for m in train}
    eval_keys = {_addition_key(m) for m in held_out}
    assert len(train_keys) == 3000 and len(eval_keys) == 300  # no duplicate (not even a + b vs b + a)
    assert not train_keys & eval_keys
    assert generate_task("addition-3", 500, 300, seed=5)[1] == held_out  # eval does not depend on num_train
    for messages in train[:300] + held_out:
        assert [m["role"] for m in messages] == ["user", "assistant"]
        a, b = _addition_key(messages)
        assert 100 <= a <= b <= 999 and int(messages[1]["content"]) == a + b


@pytest.mark.parametrize("family", ["reverse", "sort"])
def test_digit_tasks_are_deterministic_disjoint_and_right(family):
    train, held_out = generate_task(f"{family}-5", 2000, 200, seed=1)
    assert (train, held_out) == generate_task(f"{family}-5", 2000, 200, seed=1)
    number = lambda m: m[0]["content"].rstrip(".").rsplit(" ", 1)[1]  # noqa: E731
    assert not {number(m) for m in train} & {number(m) for m in held_out}
    assert len({number(m) for m in train}) == 2000
    for m in train[:200] + held_out:
        x = number(m)
        assert 2 <= len(x) <= 5 and x[0] != "0"
        assert m[1]["content"] == (x[::-1] if family == "reverse" else "".join(sorted(x)))
    assert get_task(family).name == f"{family}-6"


def test_write_task_files_are_chat_rows(tmp_path):
    paths = write_task(DEFAULT_TASK, tmp_path, 50, 10, seed=0)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    held = [json.loads(line) for line in paths["eval"].read_text().splitlines()]
    assert len(rows) == 50 and len(held) == 10
    assert all(normalize_record(r) == r["messages"] for r in rows + held)
    again = write_task(DEFAULT_TASK, tmp_path / "again", 50, 10, seed=0)
    assert again["eval"].read_text() == paths["eval"].read_text()
    assert again["train"].read_text() == paths["train"].read_text()


def test_score_and_names():
    assert score("addition-3", " 5198\n", "5198") and not score("addition-3", "5199", "5198")
    assert not score("reverse-4", "8415 apples", "8415")
    assert {"reverse-4", "sort-12", "addition-1", "addition"} <= set(list_tasks())
    for bad in ("subtraction", "reverse-1", "addition-13"):
        with pytest.raises(ConfigError, match="not a built-in task"):
            get_task(bad)
    with pytest.raises(ConfigError, match="distinct questions"):
        generate_task("addition-1", 40, 10)


def test_evaluate_task_and_perplexity_run_on_a_tiny_model(tmp_path):
    from suite.infer.evaluate import evaluate_task, perplexity

    tok = make_tokenizer(tmp_path / "tok")
    paths = write_task("reverse-4", tmp_path / "task", 40, 6, seed=1)
    model = tiny_model(len(tok))
    result = evaluate_task(
        model, tok, "reverse-4", paths["eval"], max_new_tokens=4, limit=4, template="chatml"
    )
    assert result["total"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    assert result["correct"] == sum(e["correct"] for e in result["examples"])
    first = json.loads(paths["eval"].read_text().splitlines()[0])["messages"]
    assert result["examples"][0]["prompt"] == first[0]["content"]
    assert result["examples"][0]["reference"] == first[1]["content"]
    # the eval prompt is exactly the training sample's prefix
    ds = SFTDataset.build(paths["eval"], tok, SFTOptions(seq_len=96, packing=False, template="chatml"))
    ids = prompt_ids(tok, first, CHAT_TEMPLATES["chatml"])
    assert ds.batch([0]).tokens[0, : len(ids)].tolist() == ids
    # perplexity = exp(token-weighted mean loss over targets)
    batch = ds.batch(range(len(ds)))
    with torch.no_grad():
        want = cross_entropy(model(batch.tokens, **batch.model_kwargs()), batch.labels)
    got = perplexity(model, [ds.batch([i]) for i in range(len(ds))])
    assert got["tokens"] == batch.num_targets
    assert math.isclose(got["loss"], float(want), rel_tol=1e-5)
    assert math.isclose(got["perplexity"], math.exp(float(want)), rel_tol=1e-5)
