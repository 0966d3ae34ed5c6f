"""The sliding windows of `suite eval metric=perplexity` against hand computations: which tokens each
window scores, and the summed negative log-likelihood against one forward pass per scored token."""

from __future__ import annotations

import json

import pytest
import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.infer.perplexity import check_window, sliding_window_nll, token_stream, windows


def test_windows_by_hand():
    # (begin, end, first scored): tokens 1..9 each scored once, by the window that first holds them
    assert list(windows(10, 4, 2)) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # no overlap: a window's own first token has no context in it (as in the HF guide)
    assert list(windows(10, 4, 4)) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert list(windows(10, 4, 3)) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert list(windows(5, 8, 8)) == [(0, 5, 1)]
    assert list(windows(9, 4, 4)) == [(0, 4, 1), (4, 8, 5)]  # token 8 alone: nothing to predict it from


def _model(family: str):
    from suite.models import build_model, materialize

    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_heads=4, vocab_size=64, max_seq_len=16)
    return materialize(build_model(cfg), "cpu", seed=0).eval()


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize(("seq_len", "stride", "batch"), [(8, 3, 2), (8, 8, 4), (16, 5, 1)])
def test_nll_equals_one_forward_per_token(family, seq_len, stride, batch):
    """Each scored token t of a window [b, e): -log p(tokens[t] | tokens[b:t]) from its own forward."""
    model = _model(family)
    tokens = torch.randint(0, 64, (37,), generator=torch.Generator().manual_seed(1))
    got = sliding_window_nll(model, tokens, seq_len, stride, batch)
    want, count = 0.0, 0
    with torch.no_grad():
        for b, _, first in windows(37, seq_len, stride):
            for t in range(first, min(b + seq_len, 37)):
                logp = model(tokens[None, b:t])[0, -1].log_softmax(-1)
                want -= float(logp[tokens[t]])
                count += 1
    assert got["tokens"] == count and got["windows"] == len(list(windows(37, seq_len, stride)))
    assert abs(got["nll"] - want) <= 1e-4 * abs(want)
    if stride < seq_len:
        assert count == 36  # overlapping windows score every token after the first
    # a window logic that scored other tokens would give another sum: the check can fail
    other = sliding_window_nll(model, tokens, seq_len, max(1, stride - 1), batch)
    assert other["nll"] != got["nll"]


@pytest.mark.parametrize(
    ("seq_len", "stride", "max_len", "message"),
    [
        (1, None, None, "eval.seq_len=1 must be at least 2"),
        (None, 0, None, "eval.stride=0 must be a positive integer"),
        (None, -4, None, "eval.stride=-4"),
        (16, 32, None, "eval.stride=32 is larger than eval.seq_len=16"),
        (128, None, 64, "longer than the model's context (model.max_seq_len=64)"),
    ],
)
def test_bad_windows_are_one_line(seq_len, stride, max_len, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_window(seq_len, stride, max_len)


class _Tok:
    """A character tokenizer (ids = code points) with an eos id: what token_stream needs."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_text_sources_agree(tmp_path):
    """.jsonl, a save_to_disk folder and a local data folder give the same stream: documents joined
    with eos; .txt is the whole text."""
    import datasets

    docs = ["first doc", "second one", "third"]
    joined = [ord(c) for c in "first doc"] + [0] + [ord(c) for c in "second one"] + [0]
    joined += [ord(c) for c in "third"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "test.jsonl").write_text((tmp_path / "docs.jsonl").read_text())
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(
        str(tmp_path / "saved")
    )
    (tmp_path / "plain.txt").write_text("some text")
    tok = _Tok()
    for data in (tmp_path / "docs.jsonl", f"hf:{tmp_path / 'saved'}", f"hf:{tmp_path / 'saved'}::test"):
        assert token_stream(str(data), tok, None, None)[0].tolist() == joined, data
    assert token_stream(f"hf:{tmp_path / 'local'}", tok, None, None)[0].tolist() == joined
    assert token_stream(str(tmp_path / "plain.txt"), tok, None, None)[0].tolist() == [
        ord(c) for c in "some text"
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("", "holds 0 token(s); perplexity needs at least 2"),
        ('{"txt": 1}\n', 'expected an object with a "text" string'),
    ],
)
def test_bad_data_files_are_one_line(tmp_path, content, message):
    path = tmp_path / ("data.jsonl" if content and content.startswith("{") else "data.txt")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        token_stream(str(path), _Tok(), None, None)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="has no split 'dev'"):
        (tmp_path / "split").mkdir(exist_ok=True)
        datasets_dir = tmp_path / "split" / "saved"
        if not datasets_dir.exists():
            import datasets

            datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a b"]})}).save_to_disk(
                str(datasets_dir)
            )
        token_stream(f"hf:{datasets_dir}::dev", _Tok(), None, None)
