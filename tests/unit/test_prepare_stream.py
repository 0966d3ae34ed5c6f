"""Corpus-scale `suite prepare` (issue 40): workers, resume after SIGKILL, formats, bad files, mixtures.

Tiny corpora and small parts (data.part_mb) so that many work units and parts exist in a second."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from suite.config.errors import ConfigError
from suite.config.schema import DataConfig, DataSourceConfig
from suite.data import TokenBatches, prepare, read_meta

SHARD_FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json")
WORDS = ["the", "a", "model", "token", "data", "loader", "shard", "worker", "river", "fox", "42", "1984"]


def document(i: int) -> str:
    rng = random.Random(i)
    return f"Doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(20 + i % 40)) + "."


def write_jsonl(path: Path, rows: list[dict], opener=open) -> Path:
    with opener(path, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three JSON lines files of ~150 documents each; 20 documents repeat across files."""
    root = tmp_path_factory.mktemp("stream")
    for f in range(3):
        rows = [{"text": document(f * 150 + i)} for i in range(150)] + [
            {"text": document(i)} for i in range(f * 10)
        ]
        write_jsonl(root / f"part-{f}.jsonl", rows)
    return root


def cfg_for(path: Path, **kwargs) -> DataConfig:
    sources = kwargs.pop("sources", None) or [DataSourceConfig(path=str(path))]
    kwargs.setdefault("workers", 1)  # processes only where a test is about them: each start costs ~1 s
    return DataConfig(sources=sources, vocab_size=300, val_fraction=0.05, part_mb=0.004, **kwargs)


def same_shards(a: Path, b: Path) -> None:
    for name in SHARD_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_workers_give_the_same_shards_and_count_duplicates(corpus: Path, tmp_path: Path) -> None:
    one = prepare(cfg_for(corpus, workers=1), tmp_path / "one", progress=False)
    two = prepare(cfg_for(corpus, workers=2), tmp_path / "two", progress=False)
    same_shards(one, two)
    (source,) = read_meta(one)["sources"]
    assert source["documents"] == 450 and source["duplicates"] == 30
    assert read_meta(one)["num_train_docs"] + read_meta(one)["num_val_docs"] == 450
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no work folders left


def test_a_prepare_killed_from_outside_resumes_to_the_same_bytes(corpus: Path, tmp_path: Path) -> None:
    """SIGKILL at a random moment while parts are written; the rerun continues and matches."""
    tokenizer = prepare(cfg_for(corpus), tmp_path / "whole", progress=False)
    whole = prepare(cfg_for(corpus, tokenizer=str(tokenizer)), tmp_path / "whole2", progress=False)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    command = [
        sys.executable, "-m", "suite", "prepare", f"data.path={out}", f"data.tokenizer={tokenizer}",
        f"data.sources=[{{path: '{corpus}'}}]", "data.vocab_size=300", "data.val_fraction=0.05",
        "data.part_mb=0.0005", "data.workers=2",
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(tmp_path.glob(".killed.partial-*/parts/part-00002.npz"))
        if found:
            parts = found[0].parent
            time.sleep(random.uniform(0.0, 0.05))
            break
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no cleanup runs
    proc.communicate()
    assert parts is not None, "the prepare ended before three parts were written; grow the corpus"
    assert not out.exists()  # the final folder appears only when complete
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming:" in rerun.stderr
    same_shards(whole, out)
    assert read_meta(out)["sources"][0]["duplicates"] == 30


SCRIPT = """
import sys
from pathlib import Path
from suite.cli import main
from suite.config.errors import ConfigError
from suite.config.schema import DataConfig, DataSourceConfig
from suite.data import prepare

ARGS = ["prepare", "data.sources=[{{path: '{corpus}'}}]", "data.vocab_size=300", "data.path={out}/one"]
if __name__ == "__main__":
    assert main([*ARGS, "data.workers=1"]) == 0
    print("torch imported:", "torch" in sys.modules)
try:  # unguarded: every worker re-runs this line
    cfg = DataConfig(sources=[DataSourceConfig(path="{corpus}")], workers=2, part_mb=0.001, vocab_size=300)
    prepare(cfg, Path("{out}/two"))
except ConfigError as err:
    sys.exit(f"error: {{err}}")
"""


def test_prepare_needs_no_torch_and_an_unguarded_script_gets_one_line(corpus: Path, tmp_path: Path) -> None:
    """`suite prepare` runs without importing torch (seconds at every start); a script that calls it
    with workers at import, under the spawn start method, ends in one line naming the guard to add
    (it hung: each worker re-ran the script and waited on the parent's lock)."""
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(corpus=corpus / "part-0.jsonl", out=tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )  # it hung: fails by timeout
    assert "torch imported: False" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(f"error: {script} calls suite's prepare at import")
        and '`if __name__ == "__main__":`' in last
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "two").exists()


def test_compressed_parquet_saved_streamed_and_dotted_sources_prepare_alike(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (corpus / "part-0.jsonl").read_text().splitlines()]
    nested = [{"meta": {"body": r["text"]}, "id": i} for i, r in enumerate(rows)]
    write_jsonl(tmp_path / "plain.jsonl", rows)
    write_jsonl(tmp_path / "nested.jsonl.gz", nested, gzip.open)
    with zstandard.open(tmp_path / "nested.jsonl.zst", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in nested))
    (tmp_path / "pq").mkdir()
    for k in range(2):  # a folder of Parquet files, a struct column
        pq.write_table(pa.Table.from_pylist(nested[k * 75 : (k + 1) * 75]), tmp_path / "pq" / f"{k}.parquet")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(nested).save_to_disk(str(tmp_path / "saved"))
    # a `datasets` name, streamed: the Hub is out of reach here, so a local folder serves the name
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "train.jsonl", nested)
    load = datasets.load_dataset

    def from_folder(path: str, name: str | None = None, **kwargs) -> datasets.IterableDataset:
        assert path == "someone/nested-docs" and kwargs["streaming"]
        return load(str(tmp_path / "hub"), name, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", from_folder)
    built = [prepare(cfg_for(tmp_path / "plain.jsonl"), tmp_path / "out-plain", progress=False)]
    for name in ("nested.jsonl.gz", "nested.jsonl.zst", "pq", "saved", "someone/nested-docs"):
        path = name if "/" in name else str(tmp_path / name)
        source = DataSourceConfig(path=path, text_field="meta.body")
        out = tmp_path / f"out-{name.replace('/', '-')}"
        built.append(prepare(cfg_for(tmp_path, sources=[source]), out, progress=False))
    for out in built[1:]:
        same_shards(built[0], out)


def test_a_bad_file_among_many_is_named_or_skipped_and_counted(corpus: Path, tmp_path: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for f in range(3):
        data = gzip.compress((corpus / f"part-{f}.jsonl").read_bytes())
        (folder / f"{f}.jsonl.gz").write_bytes(data[: len(data) // 2] if f == 1 else data)
    with pytest.raises(
        ConfigError, match=r"data.sources\[0\]: '.*1.jsonl.gz' is cut short or corrupt"
    ) as err:
        prepare(cfg_for(folder), tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    out = prepare(cfg_for(folder, skip_bad_files=True), tmp_path / "out", progress=False)
    assert read_meta(out)["skipped_files"] == [str(folder / "1.jsonl.gz")]


def test_min_chars_filters_and_counts(corpus: Path, tmp_path: Path) -> None:
    source = DataSourceConfig(path=str(corpus / "part-0.jsonl"), min_chars=200)
    out = prepare(cfg_for(corpus, sources=[source]), tmp_path / "out", progress=False)
    (meta,) = read_meta(out)["sources"]
    expected = sum(len(document(i)) < 200 for i in range(150))
    assert meta["filtered"] == expected > 0 and meta["documents"] == 150 - expected


def test_a_mixture_draws_exact_token_shares_and_reports_upsampling(corpus: Path, tmp_path: Path) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": document(1000 + i)} for i in range(45)])
    sources = [
        DataSourceConfig(path=str(corpus / "part-*.jsonl"), weight=0.7),
        DataSourceConfig(path=str(small), weight=0.3),
    ]
    out = prepare(cfg_for(corpus, sources=sources), tmp_path / "mix", progress=False)
    meta = read_meta(out)
    big, little = meta["sources"]
    assert little["epochs"] > 1 > big["epochs"]  # the small source is upsampled, and says so
    loader = TokenBatches(out, "train", 16, 4, 8, seed=1)
    tally, batch = np.zeros(2, dtype=np.int64), loader.source.batch

    def counted(indices: np.ndarray):  # the source of every sample the loader draws, counted here
        tally[:] += np.bincount(loader.source.starts_of(indices)[0], minlength=2) * 16
        return batch(indices)

    loader.source.batch = counted
    steps = 60
    for _ in range(steps):
        loader.next_step()
    counts = loader.tokens_by_source()  # what summary.json records (from the state, not a count)
    assert counts == tally.tolist() and sum(counts) == steps * 8 * 16
    assert abs(counts[0] / sum(counts) - 0.7) < 0.005 and abs(counts[1] / sum(counts) - 0.3) < 0.005
    resumed = TokenBatches(out, "train", 16, 4, 8, seed=1)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.tokens_by_source() == counts  # over the run, not since the resume
    loader.epoch, loader.position = 3, 2  # epochs drop their samples short of a step: counted by brute force
    n, used = loader.num_samples, loader.steps_per_epoch * 8
    drawn = np.concatenate([e * n + np.arange(used) for e in range(3)] + [3 * n + np.arange(2 * 8)])
    slots = loader.source.owner[drawn % 4096]
    assert loader.tokens_by_source() == (np.bincount(slots, minlength=2) * 16).tolist()
    loader.load_state_dict(resumed.state_dict())
    a, b = loader.next_step(), resumed.next_step()
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    sources[0].weight, sources[1].weight = 1.0, 3.0  # weight 3 on a tenth of the data: 7.5 epochs a pass
    heavy = read_meta(prepare(cfg_for(corpus, sources=sources), tmp_path / "heavy", progress=False))
    assert heavy["sources"][1]["share"] == 0.75 and heavy["sources"][1]["epochs"] > 5


def test_seen_hashes_and_txt_blocks_match_their_in_memory_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compact duplicate check is a set; a .txt read a block at a time cuts as the whole text."""
    import suite.data.seen as seen
    from suite.data.sources import pack_blocks, split_text
    from suite.data.streams import Reading, _txt_blocks

    monkeypatch.setattr(seen, "_MIN_RECENT", 4)  # merge into the sorted array often
    rng, held, check = np.random.default_rng(0), set(), seen.SeenHashes()
    for _ in range(100):
        hashes = rng.integers(0, 300, size=int(rng.integers(0, 12)), dtype=np.uint64)
        expected = [j for j, h in enumerate(hashes.tolist()) if h not in held and not held.add(h)]
        assert check.first_seen(hashes).tolist() == expected
    text = "".join(random.Random(1).choice(["ab", "\n", "\n\n", "é€", "\n\n\n"]) for _ in range(400))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    for block in (1, 2, 5, 1000):
        blocks = list(_txt_blocks(tmp_path / "t.txt", "k", Reading(), block))
        assert blocks == text.split("\n\n")
    assert list(pack_blocks(blocks, 30)) == split_text(text, 30)


class Killed(BaseException):
    """A kill injected in process: like SIGKILL, nothing catches it and no cleanup of the work runs."""


def test_a_prepare_killed_while_sampling_training_or_assembling_resumes_there(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed in the tokenizer-sample pass, in tokenizer training, then in the shard assembly: each
    rerun reads no unit and gathers no document already done, and the end matches an unkilled run.
    One unit of text a part here (data.part_mb), so "two parts kept" means two units not read again."""
    import suite.data.parts as parts

    prep = sys.modules["suite.data.prepare"]  # (suite.data.prepare is also the function's name)

    calls: dict = {"scan_unit": 0, "encode_unit": 0, "begins": []}

    def count(name: str):
        real = getattr(parts, name)
        return lambda *a: calls.__setitem__(name, calls[name] + 1) or real(*a)

    monkeypatch.setattr(parts, "scan_unit", count("scan_unit"))
    monkeypatch.setattr(parts, "encode_unit", count("encode_unit"))
    gather = parts._documents
    monkeypatch.setattr(parts, "_documents", lambda *a: calls["begins"].append(a[-1]) or gather(*a))

    def taken() -> tuple[int, int, list[int]]:
        seen = (calls["scan_unit"], calls["encode_unit"], calls["begins"])
        calls.update(scan_unit=0, encode_unit=0, begins=[])
        return seen

    def killed_at(target: object, name: str, n: int) -> None:
        """Run prepare with target.name raising Killed on its n-th call; put it back after."""
        real, seen = getattr(target, name), [0]

        def wrapped(*args, **kwargs):
            seen[0] += 1
            if seen[0] == n:
                raise Killed
            return real(*args, **kwargs)

        monkeypatch.setattr(target, name, wrapped)
        with pytest.raises(Killed):
            prepare(cfg_for(corpus), out, progress=False)
        monkeypatch.setattr(target, name, real)
        assert not out.exists()  # the final folder appears only when complete

    whole = prepare(cfg_for(corpus), tmp_path / "whole", progress=False)
    scans, encodes, _ = taken()
    out = tmp_path / "killed"
    killed_at(parts._Record, "save", 3)  # two records of the sample pass saved, killed in the third
    assert taken()[0] == 3
    killed_at(prep, "train_tokenizer", 1)  # the sample pass finished, the tokenizer not
    assert taken()[0] == scans - 2
    killed_at(parts, "_durable", 3)  # training's split: two checkpoints made, killed at the third
    assert taken()[:2] == (0, encodes)  # the finished sample is replayed, not read again
    resumed = prepare(cfg_for(corpus), out, progress=False)
    scanned, encoded, begins = taken()
    assert (scanned, encoded) == (0, 0) and begins[0] > 0  # train.bin continues after its checkpoint
    same_shards(whole, resumed)
    assert read_meta(whole) == read_meta(resumed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed", "whole"]  # no work folders left
