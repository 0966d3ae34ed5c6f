"""SFT data: row shapes, malformed rows, chat-template masking token by token, packing, batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.data.batch import IGNORE_INDEX, Batch
from suite.data.chat import (
    CHAT_TEMPLATES,
    MalformedRow,
    encode_conversation,
    normalize_record,
    prompt_ids,
    resolve_chat_template,
)
from suite.data.sft import SFTBatches, SFTDataError, SFTDataset, SFTOptions
from suite.models import build_model, materialize
from suite.models.document_attention import document_mask
from suite.train.loss import cross_entropy

CORPUS = [
    "What is 12 + 5? The answer is 17.",
    "User: hello there. Assistant: hi, how can I help you today?",
    "<|im_start|>user\nWhat is 4821 + 377?<|im_start|>assistant\n5198",
    "Be brief and answer the question with a number.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
]


def make_tokenizer(folder: Path):
    from suite.data import load_tokenizer, train_tokenizer

    train_tokenizer([CORPUS[i % len(CORPUS)] + f" {i}" for i in range(300)], 320, folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("sft_tok"))


def tiny_model(vocab: int, family: str = "gpt", seed: int = 0, max_seq_len: int = 128):
    cfg = ModelConfig(
        family=family, num_layers=2, hidden_size=64, num_heads=4, vocab_size=vocab, max_seq_len=max_seq_len
    )
    return materialize(build_model(cfg), "cpu", seed)


def chat(q: str, a: str, system: str | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    return {"messages": msgs + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- row shapes ----------------------------------------------------------------------------------
def test_every_row_shape_normalises():
    want = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    sys_want = [{"role": "system", "content": "S"}, *want]
    assert normalize_record(chat("Q", "A")) == want
    assert normalize_record(chat("Q", "A", system="S")) == sys_want
    assert (
        normalize_record({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})
        == want
    )
    assert normalize_record({"prompt": "Q", "response": "A"}) == want
    assert normalize_record({"prompt": "Q", "completion": "A", "system": "S"}) == sys_want
    assert normalize_record({"instruction": "Q", "output": "A"}) == want
    assert normalize_record({"instruction": "Q", "input": "", "output": "A"}) == want
    assert normalize_record({"instruction": "Q", "input": "ctx", "output": "A"})[0]["content"] == "Q\n\nctx"
    assert normalize_record({"prompt": "Q", "response": "A"}, system_prompt="S") == sys_want
    multi = {"messages": [*want, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}
    assert len(normalize_record(multi)) == 4


@pytest.mark.parametrize(
    "record, kind",
    [
        ({"text": "no chat here"}, "missing_fields"),
        ({"prompt": "Q"}, "missing_fields"),
        ({"instruction": "Q"}, "missing_fields"),
        ({"messages": []}, "missing_fields"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "tool", "content": "A"}]}, "bad_role"),
        ({"messages": [{"role": "assistant", "content": "A"}]}, "bad_role"),
        ({"messages": [{"role": "user", "content": "Q"}]}, "bad_role"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "user", "content": "Q"}]}, "bad_role"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Q"},
                    {"role": "system", "content": "S"},
                    {"role": "assistant", "content": "A"},
                ]
            },
            "bad_role",
        ),
        ({"prompt": "Q", "response": "   "}, "empty_response"),
        ({"prompt": "", "response": "A"}, "empty_prompt"),
        ({"prompt": "Q", "response": 17}, "bad_content"),
        ([1, 2], "missing_fields"),
    ],
)
def test_malformed_rows_are_classified(record, kind):
    with pytest.raises(MalformedRow) as err:
        normalize_record(record)
    assert err.value.kind == kind


def _bad_file(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "rows.jsonl",
        [
            chat("What is 1 + 2?", "3"),  # line 1 ok
            {"prompt": "What is 2 + 2?"},  # line 2 missing_fields
            "{not json",  # line 3 invalid_json
            chat("What is 3 + 4?", "7"),  # line 4 ok
            {"messages": [{"role": "user", "content": "Q"}, {"role": "robot", "content": "A"}]},  # 5 bad_role
            {"instruction": "Say nothing", "output": ""},  # line 6 empty_response
            chat("What is 5 + 6?", "11", system="Be brief. " * 40),  # line 7 too_long (skip policy)
            {"prompt": "What is 8 + 1?", "response": "9"},  # line 8 ok
        ],
    )


def test_malformed_rows_counted_and_skipped(tok, tmp_path):
    ds = SFTDataset.build(_bad_file(tmp_path), tok, SFTOptions(seq_len=48, truncation="skip", packing=False))
    rep = ds.report
    assert rep.rows == 8 and rep.samples == 3 and len(ds) == 3
    assert dict(rep.malformed) == {
        "missing_fields": 1,
        "invalid_json": 1,
        "bad_role": 1,
        "empty_response": 1,
        "too_long": 1,
    }
    assert "line 2" in rep.first_error["missing_fields"] and "line 7" in rep.first_error["too_long"]
    assert "5 malformed rows skipped" in rep.summary()


def test_on_error_fail_names_the_first_offending_line(tok, tmp_path):
    with pytest.raises(SFTDataError, match=r"rows\.jsonl line 2: .*missing_fields.*on_error=skip"):
        SFTDataset.build(_bad_file(tmp_path), tok, SFTOptions(seq_len=48, on_error="fail"))
    # an over-long row before any other problem is the one reported
    path = write_jsonl(tmp_path / "long.jsonl", [chat("Q", "A"), chat("Q", "A", system="x " * 200), "{bad"])
    with pytest.raises(SFTDataError, match=r"long\.jsonl line 2: .*too_long"):
        SFTDataset.build(path, tok, SFTOptions(seq_len=48, truncation="skip", on_error="fail"))


def test_all_rows_malformed_is_an_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, {"text": "y"}])
    with pytest.raises(ConfigError, match="no usable SFT samples.*line 1"):
        SFTDataset.build(path, tok, SFTOptions(seq_len=48))


# ---- masking token by token ----------------------------------------------------------------------
def _decode_targets(tok, tokens: torch.Tensor, labels: torch.Tensor) -> str:
    return tok.decode(labels[labels != IGNORE_INDEX].tolist())


@pytest.mark.parametrize("template", ["chatml", "plain"])
def test_labels_are_exactly_the_assistant_reply_and_its_end_token(tok, tmp_path, template):
    path = write_jsonl(tmp_path / "one.jsonl", [chat("What is 12 + 5?", "17", system="Be brief.")])
    ds = SFTDataset.build(path, tok, SFTOptions(seq_len=64, template=template, packing=False))
    b = ds.batch([0])
    tokens, labels = b.tokens[0], b.labels[0]
    assert _decode_targets(tok, tokens, labels) == "17" + tok.eos_token
    labelled = (labels != IGNORE_INDEX).nonzero().flatten()
    # shifted: the label at t is the next input token; the reply tokens are the last targets
    assert torch.equal(labels[labelled[:-1]], tokens[labelled[:-1] + 1])
    assert int(labels[labelled[-1]]) == tok.eos_token_id
    # everything before the reply (system, user, template tokens) and all padding is masked
    messages = normalize_record(chat("What is 12 + 5?", "17", system="Be brief."))
    prompt = prompt_ids(tok, messages, CHAT_TEMPLATES[template])
    assert tokens[: len(prompt)].tolist() == prompt
    assert int(labelled[0]) == len(prompt) - 1  # the last prompt token predicts the first reply token
    n = len(prompt) + len(tok("17", add_special_tokens=False)["input_ids"])  # inputs: prompt + reply
    assert (labels[: len(prompt) - 1] == IGNORE_INDEX).all()
    assert (labels[n:] == IGNORE_INDEX).all() and (tokens[n:] == tok.pad_token_id).all()


def test_multi_turn_labels_every_assistant_turn_only(tok):
    msgs = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ]
    ids, flags = encode_conversation(tok, msgs, CHAT_TEMPLATES["chatml"])
    eos = tok.eos_token
    assert tok.decode([i for i, f in zip(ids, flags) if f]) == f"3{eos}8{eos}"
    user_ids = tok("And 4 + 4?", add_special_tokens=False)["input_ids"]
    text_of_unflagged = tok.decode([i for i, f in zip(ids, flags) if not f])
    assert "What is 1 + 2?" in text_of_unflagged and tok.decode(user_ids) in text_of_unflagged


@pytest.mark.parametrize("template", ["chatml", "plain"])
def test_spans_agree_with_transformers_assistant_mask(tok, template):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And 40 + 4?"},
        {"role": "assistant", "content": "44"},
    ]
    ids, flags = encode_conversation(tok, msgs, CHAT_TEMPLATES[template])
    out = tok.apply_chat_template(
        msgs,
        chat_template=CHAT_TEMPLATES[template],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    # transformers keeps the whitespace after the last turn; we drop it (it is never a target)
    assert out["input_ids"][: len(ids)] == ids
    assert [bool(m) for m in out["assistant_masks"][: len(ids)]] == flags


def test_tokenizer_template_used_and_non_incremental_template_reported(tok, tmp_path):
    assert resolve_chat_template(tok, "auto") == CHAT_TEMPLATES["chatml"]  # no template of its own
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok.chat_template = own
    try:
        assert resolve_chat_template(tok, "auto") == own
        # a template that rewrites history (numbers the turns from the end) cannot be split safely
        weird = "{% for m in messages %}{{ messages|length - loop.index }}{{ m['content'] }}{% endfor %}"
        path = write_jsonl(tmp_path / "w.jsonl", [chat("Q", "A")])
        with pytest.raises(ConfigError, match="template_error"):
            SFTDataset.build(path, tok, SFTOptions(seq_len=48, template=weird))
    finally:
        tok.chat_template = None
    with pytest.raises(ConfigError, match="tokenizer has no chat_template"):
        resolve_chat_template(tok, "tokenizer")


def test_truncate_drops_from_the_left_and_keeps_the_reply(tok, tmp_path):
    rows = [chat("What is 12 + 5?", "17", system="Be brief and answer. " * 12), chat("Q", "1 2 3 4 5 " * 10)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = SFTDataset.build(path, tok, SFTOptions(seq_len=40, truncation="truncate", packing=False))
    assert ds.report.truncated == 1 and dict(ds.report.malformed) == {"too_long": 1}
    assert "final assistant reply alone" in ds.report.first_error["too_long"]
    b = ds.batch([0])
    assert _decode_targets(tok, b.tokens[0], b.labels[0]) == "17" + tok.eos_token
    assert (b.tokens[0] != tok.pad_token_id).all()  # exactly full: seq_len + 1 tokens kept
    assert "What is 12 + 5?" in tok.decode(b.tokens[0].tolist())


def _loss_and_grads(model, b: Batch):
    model.zero_grad(set_to_none=True)
    logits = model(b.tokens, **b.model_kwargs())
    logits.retain_grad()
    loss = cross_entropy(logits, b.labels)
    loss.backward()
    return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packing", [False, True])
def test_loss_and_gradient_ignore_prompt_and_padding(tok, tmp_path, packing):
    rows = [chat(f"What is {i} + {2 * i}?", str(3 * i)) for i in range(1, 7)]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    ds = SFTDataset.build(path, tok, SFTOptions(seq_len=64, packing=packing))
    batch = ds.batch(range(len(ds)))
    model = tiny_model(len(tok))
    loss, logits, grads = _loss_and_grads(model, batch)
    masked = batch.labels == IGNORE_INDEX
    assert masked.any() and (~masked).any()
    assert (logits.grad[masked] == 0).all()  # no gradient reaches the logits at prompt/pad positions
    assert (logits.grad[~masked].abs().sum(-1) > 0).all()
    # the loss is the mean over the assistant targets only, computed by hand
    logp = logits.detach().float().log_softmax(-1)
    picked = logp[~masked].gather(-1, batch.labels[~masked][:, None]).squeeze(-1)
    torch.testing.assert_close(loss, -picked.mean())
    # scramble the padding tokens: neither the loss nor any parameter gradient changes
    if packing:
        pad = batch.doc_ids == -1
    else:
        lengths = (batch.labels != IGNORE_INDEX).long().cumsum(1).argmax(1) + 1  # through the last target
        pad = torch.arange(batch.tokens.shape[1])[None] >= lengths[:, None]
    assert pad.any() and (batch.labels[pad] == IGNORE_INDEX).all()
    noisy = batch.tokens.clone()
    noisy[pad] = torch.randint(0, len(tok), (int(pad.sum()),), generator=torch.Generator().manual_seed(0))
    loss2, _, grads2 = _loss_and_grads(model, Batch(noisy, batch.labels, batch.positions, batch.doc_ids))
    torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_sample_logits_equal_the_sample_alone(tok, tmp_path, family):
    rows = [
        chat("What is 12 + 5?", "17"),
        chat("What is 4821 + 377?", "5198", system="Be brief."),
        chat("Hi", "hello there"),
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    packed = SFTDataset.build(path, tok, SFTOptions(seq_len=128, packing=True, shuffle_seed=3))
    alone = SFTDataset.build(path, tok, SFTOptions(seq_len=128, packing=False))
    assert len(packed) == 1 and len(alone) == 3
    model = tiny_model(len(tok), family)
    pb = packed.batch([0])
    with torch.no_grad():
        packed_logits = model(pb.tokens, **pb.model_kwargs())[0]
    doc = pb.doc_ids[0]
    found = 0
    for r in range(3):
        b = alone.batch([r])
        n = int((b.labels[0] != IGNORE_INDEX).nonzero().max()) + 1  # through the last target position
        with torch.no_grad():
            ref = model(b.tokens[:, :n], positions=b.positions[:, :n])[0]
        for d in range(int(doc.max()) + 1):
            sel = doc == d
            if int(sel.sum()) >= n and torch.equal(pb.tokens[0][sel][:n], b.tokens[0, :n]):
                assert torch.equal(pb.labels[0][sel][:n], b.labels[0, :n])
                assert torch.equal(pb.positions[0][sel][:n], torch.arange(n))
                torch.testing.assert_close(packed_logits[sel][:n], ref, rtol=1e-5, atol=1e-5)
                found += 1
    assert found == 3


def test_document_mask():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = document_mask(doc)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], want)


# ---- sources and batches -------------------------------------------------------------------------
def test_parquet_and_json_sources(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": "What is 1 + 1?", "response": "2"}, {"prompt": "What is 2 + 2?", "response": None}]
        ),
        tmp_path / "a.parquet",
    )
    (tmp_path / "b.json").write_text(json.dumps([{"instruction": "Add 3 and 4", "output": "7"}]))
    ds = SFTDataset.build(str(tmp_path / "*"), tok, SFTOptions(seq_len=48, packing=False))
    assert ds.report.rows == 3 and ds.report.samples == 2
    assert "a.parquet row 2" in ds.report.first_error["missing_fields"]


def test_a_file_in_another_encoding_is_refused_whatever_the_row_policy(tok, tmp_path):
    """Encoding is the file's problem, not a row's: on_error=skip does not skip a Latin-1 file row by row."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(chat("Q", "A")) + "\n"
    path.write_bytes(
        good.encode() + (json.dumps(chat("café ?", "oui"), ensure_ascii=False) + "\n").encode("latin-1")
    )
    with pytest.raises(ConfigError, match=r"'.*latin1.jsonl' is not UTF-8 text \(line 2, byte \d+: 0xe9\)"):
        SFTDataset.build(str(path), tok, SFTOptions(seq_len=48, on_error="skip"))
    (tmp_path / "rows.parquet").write_text(good)
    with pytest.raises(ConfigError, match=r"'.*rows.parquet' is not a Parquet file.*`cp .*rows.jsonl`"):
        SFTDataset.build(str(tmp_path / "rows.parquet"), tok, SFTOptions(seq_len=48))


def _dataset(tok, tmp_path, n=40):
    rows = [chat(f"What is {i} + {i + 1}?", str(2 * i + 1)) for i in range(n)]
    return SFTDataset.build(
        write_jsonl(tmp_path / "d.jsonl", rows), tok, SFTOptions(seq_len=32, packing=False)
    )


def test_batches_slice_the_global_batch_across_ranks_and_resume(tok, tmp_path):
    ds = _dataset(tok, tmp_path)
    one = SFTBatches(ds, micro_batch_size=2, global_batch_size=8, seed=5)
    ranks = [
        SFTBatches(ds, micro_batch_size=4, global_batch_size=8, dp_rank=r, dp_size=2, seed=5)
        for r in range(2)
    ]
    for _ in range(7):  # crosses an epoch boundary (5 steps per epoch)
        whole = torch.cat([b.tokens for b in one.next_step()])
        parts = torch.cat([b.tokens for r in ranks for b in r.next_step()])
        assert torch.equal(whole, parts)
    state = one.state_dict()
    expected = one.next_step()
    fresh = SFTBatches(ds, micro_batch_size=2, global_batch_size=8, seed=5)
    fresh.load_state_dict(state)
    got = fresh.next_step()
    assert all(
        torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels) for a, b in zip(expected, got)
    )
    assert one.epoch == 1 and one.steps_per_epoch == 5
    evals = one.eval_batches(2)
    assert len(evals) == 8 and torch.equal(
        torch.cat([b.tokens for b in evals]), ds.batch(np.arange(16)).tokens
    )
    other = SFTDataset.build(
        write_jsonl(tmp_path / "e.jsonl", [chat("Q", "A")] * 12), tok, SFTOptions(seq_len=32)
    )
    with pytest.raises(ConfigError, match="packs into"):
        SFTBatches(other, 2, 8).load_state_dict(state)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        SFTBatches(other, 2, 16)
