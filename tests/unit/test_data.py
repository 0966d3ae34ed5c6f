"""suite.data: tokenizer, shards, prepare, loader and the embedded corpus (small and fast)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from suite.config.errors import ConfigError
from suite.config.schema import DataConfig, DataSourceConfig
from suite.data import (
    IndexedTokens,
    ShardWriter,
    TokenBatches,
    build_embedded_corpus,
    ensure_prepared,
    is_prepared,
    load_tokenizer,
    prepare,
    read_meta,
    train_tokenizer,
)
from suite.data.batch import Batch

SUBJECTS = [
    "The model",
    "A small tokenizer",
    "Every optimizer",
    "The data loader",
    "Our cluster",
    "This shard",
]
VERBS = ["reads", "writes", "counts", "shuffles", "compresses", "trains on"]
OBJECTS = [
    "the tokens",
    "many documents",
    "a long sequence",
    "the gradients",
    "several batches",
    "its inputs",
]


def sentences(n: int = 300) -> list[str]:
    """Deterministic English-like sentences with numbers in them."""
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 6], VERBS[(i // 6) % 6], OBJECTS[(i // 36) % 6]
        out.append(f"{s} {v} {o} in step {i * 37 % 1000} of {1990 + i % 30}.")
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(sentences(), 300, out)
    return out


# --- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_digits(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    text = "The model reads 12345 tokens in 2024!\n\tUnicode: ünïcødé €"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("x 90817", add_special_tokens=False))[-5:] == list("90817")
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tok.eos_token_id == 0 and tok.pad_token == "<|pad|>"
    assert len(tok) <= 300


def test_tokenizer_loads_with_auto_and_from_file(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == 0
    assert auto.pad_token_id == auto.convert_tokens_to_ids("<|pad|>")
    bare = load_tokenizer(tok_dir / "tokenizer.json")
    assert bare.eos_token_id == 0 and bare.pad_token == "<|pad|>"
    assert bare.encode("step 42", add_special_tokens=False) == auto.encode(
        "step 42", add_special_tokens=False
    )


def test_tokenizer_training_is_deterministic(tok_dir: Path, tmp_path: Path) -> None:
    again = train_tokenizer(sentences(), 300, tmp_path)
    assert again.read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_tokenizer_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        load_tokenizer(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(ConfigError, match="bad/tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(ConfigError, match="data.vocab_size=100"):
        train_tokenizer(["hello"], 100, tmp_path / "small")


def test_a_gguf_tokenizer_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    """data.tokenizer=<file>.gguf reads the file's metadata (the good case: tests/e2e/test_real_model.py);
    not a GGUF, or a GGUF without a tokenizer, is a ConfigError naming the file."""
    import gguf

    (tmp_path / "text.gguf").write_text("not a gguf file\n" * 8)
    with pytest.raises(ConfigError, match=r"tokenizer '.*text.gguf': not a readable GGUF file \(GGUF magic"):
        load_tokenizer(tmp_path / "text.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "weights.gguf"), "llama")  # weights, no tokenizer metadata
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"tokenizer '.*weights.gguf': its tokenizer cannot be rebuilt"):
        load_tokenizer(tmp_path / "weights.gguf")


# --- shards ----------------------------------------------------------------------------------------


def write_docs(prefix: Path, docs: list[np.ndarray], vocab: int) -> None:
    with ShardWriter(prefix, vocab) as writer:
        for doc in docs:
            writer.add_document(doc)


@pytest.mark.parametrize("vocab, dtype", [(300, np.uint16), (70_000, np.uint32)])
def test_shard_round_trip(tmp_path: Path, vocab: int, dtype: type) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=int(n)) for n in rng.integers(0, 50, size=40)]
    write_docs(tmp_path / "s", docs, vocab)
    shard = IndexedTokens(tmp_path / "s")
    assert shard.num_docs == 40 and shard.num_tokens == sum(len(d) for d in docs)
    assert shard.tokens.dtype == dtype and not shard.tokens.flags.writeable
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(shard.document(i), doc)
    assert (tmp_path / "s.bin").stat().st_size == shard.num_tokens * np.dtype(dtype).itemsize
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]  # no temp files left


def test_shard_truncated_or_corrupt_raises(tmp_path: Path) -> None:
    write_docs(tmp_path / "s", [np.arange(100), np.arange(50)], 300)
    with open(tmp_path / "s.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match="truncated"):
        IndexedTokens(tmp_path / "s")
    (tmp_path / "s.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ConfigError, match="s.idx"):
        IndexedTokens(tmp_path / "s")
    with pytest.raises(ConfigError, match="missing"):
        IndexedTokens(tmp_path / "absent")


def test_shard_writer_rejects_out_of_vocab(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "s", 300)
    with pytest.raises(ValueError, match="out of range"):
        writer.add_document([1, 300])
    writer.abort()
    assert not list(tmp_path.iterdir())


# --- prepare ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    lines = sentences(300)
    paragraphs = ["\n".join(lines[i : i + 5]) for i in range(0, 150, 5)]
    (root / "book.txt").write_text("\n\n".join(paragraphs))
    with open(root / "records.jsonl", "w") as f:
        for i, line in enumerate(lines[150:]):
            f.write(json.dumps({"body": f"Record {i}: {line}", "id": i}) + "\n")
    return root


def local_cfg(root: Path, **kwargs) -> DataConfig:
    sources = [
        DataSourceConfig(path=str(root / "*.txt"), weight=1.0),
        DataSourceConfig(path=str(root / "records.jsonl"), weight=2.0, text_field="body"),
    ]
    return DataConfig(sources=sources, vocab_size=300, val_fraction=0.1, **kwargs)


def split_texts(folder: Path, split: str) -> list[str]:
    tok = load_tokenizer(folder)
    shard = IndexedTokens(folder / split)
    texts = []
    for i in range(shard.num_docs):
        doc = shard.document(i)
        assert doc[-1] == 0  # every document ends with <|endoftext|>
        texts.append(tok.decode(doc[:-1].tolist()))
    return texts


def test_prepare_local_sources_with_weights(sources_dir: Path, tmp_path: Path) -> None:
    from suite.data.sources import split_text

    out = prepare(local_cfg(sources_dir, seq_len=16), tmp_path / "prepared", progress=False)
    assert is_prepared(out)
    meta = read_meta(out)
    assert meta["format_version"] == 1 and meta["eos_id"] == 0 and meta["vocab_size"] <= 300
    txt_docs = split_text((sources_dir / "book.txt").read_text())
    records = [json.loads(line)["body"] for line in (sources_dir / "records.jsonl").read_text().splitlines()]
    assert [s["num_docs"] for s in meta["sources"]] == [len(txt_docs), len(records)]

    train, val = Counter(split_texts(out, "train")), Counter(split_texts(out, "val"))
    assert meta["num_val_docs"] == sum(val.values()) >= 1
    assert not set(train) & set(val)  # no document leaks across the split
    assert set(train) | set(val) == set(txt_docs) | set(records)
    assert set(train.values()) == {1}  # each document once: weights are the loader's token shares
    assert [s["share"] for s in meta["sources"]] == pytest.approx([1 / 3, 2 / 3], abs=1e-6)
    ranges = meta["train_ranges"]  # each source's documents, together, in train.bin
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == meta["num_train_tokens"]
    assert meta["num_train_tokens"] == IndexedTokens(out / "train").num_tokens

    again = prepare(local_cfg(sources_dir, seq_len=16), tmp_path / "again", progress=False)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "prepared"]  # no temp folders left


def test_a_prepared_folder_is_claimed_only_by_the_same_sources_files_and_settings(
    sources_dir: Path, tmp_path: Path
) -> None:
    """`suite prepare` into a prepared folder (suite.folders' rule): the same config and source files
    find nothing to do; another setting, or a source file rewritten in place, is refused naming the
    difference unless --overwrite; damaged shards are rebuilt. Fails if the record leaves out the files' sizes and times (a
    rewritten corpus would keep the old shards) or a setting such as the vocabulary."""
    from suite.data.prepare import claim_prepared

    sources = tmp_path / "sources"
    shutil.copytree(sources_dir, sources)
    out = prepare(local_cfg(sources), tmp_path / "p", progress=False)
    assert claim_prepared(local_cfg(sources), out, overwrite=False)  # nothing to do
    damaged = shutil.copytree(out, tmp_path / "damaged")
    with open(damaged / "train.bin", "r+b") as f:
        f.write(b"\xff\xff")
    assert not claim_prepared(local_cfg(sources), damaged, overwrite=False)  # rebuilt, as its refusal says
    with pytest.raises(ConfigError, match="data.vocab_size: 300 there, 400 now.*--overwrite"):
        claim_prepared(DataConfig(**{**vars(local_cfg(sources)), "vocab_size": 400}), out, overwrite=False)
    with open(sources / "book.txt", "a") as f:
        f.write("\n\nOne more paragraph, written after the folder was prepared.")
    with pytest.raises(ConfigError, match=r"source: 2 source file\(s\), sizes and times \w+ there, .* now"):
        claim_prepared(local_cfg(sources), out, overwrite=False)
    assert not claim_prepared(local_cfg(sources), out, overwrite=True)  # build; the old one moves aside


def test_prepare_reuses_a_tokenizer_and_replaces_a_prepared_folder(
    sources_dir: Path, tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "p"
    prepare(local_cfg(sources_dir), out, progress=False)
    first = read_meta(out)
    prepare(local_cfg(sources_dir, tokenizer=str(tok_dir)), out, progress=False)
    assert read_meta(out)["tokenizer"] == str(tok_dir)
    # the older folder is moved aside whole (never deleted: a run may still read it), and the line says where
    assert read_meta(tmp_path / "p.old-1") == first
    assert f"moved the previous prepared data in {out} to {tmp_path / 'p.old-1'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p", "p.old-1"]
    reused, original = load_tokenizer(out), load_tokenizer(tok_dir)
    assert reused.get_vocab() == original.get_vocab()
    text = "The data loader shuffles 77 batches."
    assert reused.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)


def test_prepare_and_ensure_prepared_errors(sources_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a prepared data folder"):
        prepare(local_cfg(sources_dir), tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match=r"data.path='.*mine'.*suite prepare"):
        ensure_prepared(DataConfig(path=str(tmp_path / "mine")))
    bad = DataConfig(sources=[DataSourceConfig(path=str(tmp_path / "none" / "*.txt"))], vocab_size=300)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path=.*matches no files"):
        prepare(bad, tmp_path / "out", progress=False)
    wrong_field = DataConfig(
        sources=[DataSourceConfig(path=str(sources_dir / "records.jsonl"))], vocab_size=300
    )
    with pytest.raises(ConfigError, match=r"data.sources\[0\].text_field='text'"):
        prepare(wrong_field, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_gzipped_jsonl_and_a_saved_datasets_folder_prepare_as_the_jsonl_does(
    sources_dir: Path, tmp_path: Path
) -> None:
    """The same records as .jsonl, .jsonl.gz or a `datasets` save_to_disk folder: the same shards."""
    import gzip

    import datasets

    records = sources_dir / "records.jsonl"
    (tmp_path / "records.jsonl.gz").write_bytes(gzip.compress(records.read_bytes()))
    datasets.disable_progress_bars()
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    built = []
    for path in (records, tmp_path / "records.jsonl.gz", tmp_path / "saved"):
        source = DataSourceConfig(path=str(path), text_field="body")
        cfg = DataConfig(sources=[source], vocab_size=300, val_fraction=0.1)
        built.append(prepare(cfg, tmp_path / f"out-{len(built)}", progress=False))
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert len({(out / name).read_bytes() for out in built}) == 1, name


def test_ensure_prepared_embedded_default_builds_once(tmp_path: Path) -> None:
    cfg = DataConfig(cache_dir=str(tmp_path), vocab_size=300, max_corpus_mb=0.03)
    folder = ensure_prepared(cfg, progress=False)
    assert folder.parent == tmp_path and folder.name == "embedded-v1-vocab300-mb0.03"
    stamp = (folder / "meta.json").stat().st_mtime_ns
    assert ensure_prepared(cfg, progress=False) == folder
    assert (folder / "meta.json").stat().st_mtime_ns == stamp
    assert read_meta(folder)["num_train_tokens"] > 1000
    assert ensure_prepared(DataConfig(path=str(folder))) == folder


# --- loader ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token k of the stream is k, so every window must be consecutive integers."""
    root = tmp_path_factory.mktemp("stream")
    stream = np.arange(3001)
    write_docs(root / "train", np.array_split(stream, 37), 65536)
    write_docs(root / "val", [np.arange(1000)], 65536)
    return root


def windows(batches: list[Batch]) -> list[torch.Tensor]:
    """The [b, s + 1] token windows the micro-batches were cut from (inputs and the shifted targets)."""
    return [torch.cat([b.tokens, b.labels[:, -1:]], dim=1) for b in batches]


def steps(batches: TokenBatches, n: int) -> list[list[torch.Tensor]]:
    return [windows(batches.next_step()) for _ in range(n)]


def test_loader_windows_and_determinism(stream_dir: Path) -> None:
    a = TokenBatches(stream_dir, "train", 8, 4, 16, seed=3)
    b = TokenBatches(stream_dir, "train", 8, 4, 16, seed=3)
    assert a.num_samples == 375 and a.steps_per_epoch == 23
    for step_a, step_b in zip(steps(a, 30), steps(b, 30)):  # crosses an epoch boundary
        assert len(step_a) == 4
        for x, y in zip(step_a, step_b):
            assert x.dtype == torch.int64 and x.shape == (4, 9)
            assert torch.equal(x, y)
            assert torch.equal(x - x[:, :1], torch.arange(9).expand(4, 9)) and bool((x[:, 0] % 8 == 0).all())
    epoch = torch.cat([torch.cat(s) for s in steps(TokenBatches(stream_dir, "train", 8, 4, 16, seed=3), 23)])
    assert len(set(epoch[:, 0].tolist())) == 23 * 16  # no sample repeats within an epoch
    other = windows(TokenBatches(stream_dir, "train", 8, 4, 16, seed=4).next_step())
    assert not torch.equal(
        torch.cat(other), torch.cat(windows(TokenBatches(stream_dir, "train", 8, 4, 16, seed=3).next_step()))
    )


@pytest.mark.parametrize("micro_single, micro_dp", [(8, 8), (4, 2), (16, 8)])
def test_loader_dp_slicing_equivalence(stream_dir: Path, micro_single: int, micro_dp: int) -> None:
    single = TokenBatches(stream_dir, "train", 8, micro_single, 16, seed=7)
    ranks = [TokenBatches(stream_dir, "train", 8, micro_dp, 16, dp_rank=r, dp_size=2, seed=7) for r in (0, 1)]
    for _ in range(25):
        whole = torch.cat(windows(single.next_step()))
        parts = [torch.cat(windows(r.next_step())) for r in ranks]
        assert torch.equal(whole, torch.cat(parts))
    evals = [
        torch.cat(windows(r.eval_batches(2))) for r in ranks
    ]  # per rank: its 8 rows of step 0, then step 1
    interleaved = torch.cat([evals[0][:8], evals[1][:8], evals[0][8:], evals[1][8:]])
    assert torch.equal(torch.cat(windows(single.eval_batches(2))), interleaved)


def test_loader_resume_from_state_dict(stream_dir: Path) -> None:
    first = TokenBatches(stream_dir, "train", 8, 4, 16, seed=1)
    steps(first, 21)
    state = first.state_dict()
    expected = steps(first, 6)  # crosses into the next epoch
    resumed = TokenBatches(stream_dir, "train", 8, 4, 16, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    for want, got in zip(expected, steps(resumed, 6)):
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_prefetching_loader_gives_the_same_batches_and_state(stream_dir: Path) -> None:
    """data.prefetch gathers step n+1 in a thread while step n runs: same batches, same state,
    across an epoch boundary and after load_state_dict (a resume or a rollback)."""
    plain = TokenBatches(stream_dir, "train", 8, 4, 16, seed=2)
    ahead = TokenBatches(stream_dir, "train", 8, 4, 16, seed=2, prefetch=True)
    for _ in range(25):  # 23 steps per epoch
        want, got = windows(plain.next_step()), windows(ahead.next_step())
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert plain.state_dict() == ahead.state_dict()
    state = {"epoch": 0, "position": 5, "seed": 2, "num_samples": plain.num_samples}
    plain.load_state_dict(state)
    ahead.load_state_dict(state)  # the prefetched step 26 must not be served
    assert all(torch.equal(w, g) for w, g in zip(windows(plain.next_step()), windows(ahead.next_step())))


def test_loader_eval_batches_in_order(stream_dir: Path) -> None:
    val = TokenBatches(stream_dir, "val", 8, 4, 16)
    batches = windows(val.eval_batches(10))
    assert len(batches) == 7 * 4  # (999 // 8) // 16 = 7 global batches available, capped
    starts = torch.cat(batches)[:, 0]
    assert torch.equal(starts, torch.arange(7 * 16) * 8)
    assert all(torch.equal(x, y) for x, y in zip(batches, windows(val.eval_batches(10))))


def test_loader_errors(stream_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"parallel.global_batch_size=200 x data.seq_len=8"):
        TokenBatches(stream_dir, "val", 8, 4, 200, dp_size=2)
    with pytest.raises(ConfigError, match="parallel.global_batch_size=16 must be a multiple"):
        TokenBatches(stream_dir, "train", 8, 3, 16)
    with pytest.raises(ConfigError, match="missing"):
        TokenBatches(stream_dir, "test", 8, 4, 16)


# --- embedded corpus -------------------------------------------------------------------------------


def test_embedded_corpus_is_deterministic(tmp_path: Path) -> None:
    a = build_embedded_corpus(tmp_path / "a", 0.2)
    b = build_embedded_corpus(tmp_path / "b", 0.2)
    data = a.read_bytes()
    assert data == b.read_bytes()
    texts = [json.loads(line)["text"] for line in data.decode().splitlines()]
    size = sum(len(t.encode()) for t in texts)
    assert 100_000 < size <= 200_000 and len(texts) > 10
    assert all(len(t) >= 40 for t in texts)


@pytest.mark.parametrize("rows, dp", [(32, 2), (32, 4), (12, 4), (999, 2)])
def test_eval_rows_are_the_same_rows_at_every_data_parallel_degree(
    stream_dir: Path, rows: int, dp: int
) -> None:
    """train.eval_batches x micro_batch_size rows, dealt to the data ranks: val_loss does not depend on dp
    (before, each rank took eval_batches micro-batches of its own: dp times the rows of one process)."""
    single = torch.cat(windows(TokenBatches(stream_dir, "val", 8, 4, 4).eval_rows(rows)))
    ranks = [TokenBatches(stream_dir, "val", 8, 4, 4 * dp, dp_rank=r, dp_size=dp) for r in range(dp)]
    parts = [windows(r.eval_rows(rows)) for r in ranks]
    assert len({len(p) for p in parts}) == 1  # as many forwards on every rank
    held = (999 // 8) - (999 // 8) % dp  # capped at the split, a multiple of the ranks
    assert torch.equal(torch.cat([torch.cat(p) for p in parts]), single[: min(rows, held)])
    assert single.shape[0] == min(rows, 999 // 8)
