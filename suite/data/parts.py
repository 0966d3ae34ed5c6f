"""`suite prepare`'s passes over the stream: the tokenizer sample, the resumable parts, the final shards.

1. `sample_pass` (only when a tokenizer is trained): every document is hashed; the sample is the
   documents with the smallest content hashes that fit in `budget` characters (a bottom-k reservoir:
   bounded, and the same whatever the order or number of workers; a corpus that fits is taken whole).
2. `tokenize_parts`: documents in stream order, exact duplicates dropped by hash, into numbered parts
   (`part-NNNNN.bin/.idx` and `.npz`: hashes, sources and counts). A part is complete when its .npz
   exists; a rerun loads the hashes of the complete parts and skips their units unread by workers.
3. `assemble`: the train/val split and the training order (one permutation of document ids, as
   before streaming), then train.bin/val.bin gathered from the parts with positioned reads, so
   memory stays at a few arrays of one number per document.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from suite.config.errors import ConfigError
from suite.data.seen import SeenHashes
from suite.data.shards import IndexedTokens, ShardWriter, dtype_for, write_index
from suite.data.workers import Encoded, Pool, Scanned, encode_unit, scan_unit

# columns of the per-source counts
DOCS, TOKENS, DUPLICATES, FILTERED, BAD, TEXT_BYTES = range(6)
COUNTS = ("documents", "tokens", "duplicates", "filtered", "bad_records", "text_bytes")
_SPLIT_SEED, _ORDER_SEED = 20240501, 20240503
PASS_DONE = "done"  # written when a pass has read every unit: a rerun takes its records, reading nothing


@dataclass
class Totals:
    """Per-source counts (rows: sources, columns: COUNTS) and each kept document's source."""

    counts: np.ndarray
    owners: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))

    def add(self, source: int, column: int, n: int) -> None:
        self.counts[source, column] += n


def part_name(i: int) -> str:
    return f"part-{i:05d}"


def complete_parts(parts: Path) -> int:
    """How many parts from the first on are complete (their .npz, written last, exists)."""
    n = 0
    while (parts / f"{part_name(n)}.npz").is_file():
        n += 1
    return n


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sample_pass(
    units: Iterable[Any],
    pool: Pool,
    budget: int,
    num_sources: int,
    tick: Callable[[int, int], None],
    folder: Path,
    units_per_part: int,
) -> tuple[Totals, dict[int, str]]:
    """Every document's source, and the tokenizer sample {document index: text} (train and val).

    Resumable like the parts: every `units_per_part` units a numbered record of what the pass took
    (the kept documents' hashes and sources, the counts, the texts pushed into the reservoir) goes to
    `folder`; a rerun replays the complete records and reads on after them, and once the pass has
    finished (`folder`/done) it replays them without reading the sources."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp*"):  # what a killed run was writing
        stale.unlink(missing_ok=True)
    reservoir = _Reservoir(budget, num_sources)
    done = complete_parts(folder)
    for i in range(done):
        with np.load(folder / f"{part_name(i)}.npz") as saved:
            reservoir.replay(saved)
    if not (folder / PASS_DONE).is_file():
        record = _Record(num_sources)
        rest = itertools.islice(units, done * units_per_part, None)
        for scanned in pool.map(scan_unit, rest, lambda: (reservoir.threshold,)):
            assert isinstance(scanned, Scanned)
            reservoir.add(scanned, record)
            tick(scanned.text_bytes, 0)
            if record.units == units_per_part:
                record.save(folder / f"{part_name(done)}.npz")
                done, record = done + 1, _Record(num_sources)
        if record.units:
            record.save(folder / f"{part_name(done)}.npz")
        (folder / PASS_DONE).write_text("done\n")
    return reservoir.totals(), reservoir.sample()


class _Record:
    """What the sample pass took from a run of units: enough to replay it into a `_Reservoir`."""

    def __init__(self, num_sources: int) -> None:
        self.hashes: list[np.ndarray] = []
        self.owners: list[np.ndarray] = []
        self.counts = np.zeros((num_sources, len(COUNTS)), dtype=np.int64)
        self.pushed: list[tuple[int, int, str]] = []  # (hash, document index, text), in push order
        self.units = 0

    def save(self, path: Path) -> None:
        texts = [t.encode("utf-8", "surrogatepass") for _, _, t in self.pushed]
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        _save_npz(
            path,
            hashes=np.concatenate(self.hashes) if self.hashes else np.zeros(0, dtype=np.uint64),
            owners=np.concatenate(self.owners) if self.owners else np.zeros(0, dtype=np.int16),
            counts=self.counts,
            pushed_hashes=np.array([h for h, _, _ in self.pushed], dtype=np.uint64),
            pushed_index=np.array([i for _, i, _ in self.pushed], dtype=np.int64),
            pushed_lengths=lengths,
            pushed_text=np.frombuffer(b"".join(texts), dtype=np.uint8),
        )


class _Reservoir:
    """The sample pass's state: the hashes seen, every kept document's source, the counts, and the
    bottom-k reservoir (the documents of smallest hash that fit in `budget` characters)."""

    def __init__(self, budget: int, num_sources: int) -> None:
        self.budget = budget
        self.seen = SeenHashes()
        self.owners: list[np.ndarray] = []
        self.counts = np.zeros((num_sources, len(COUNTS)), dtype=np.int64)
        self.heap: list[tuple[int, int, str]] = []  # (-hash, index, text): the largest hash on top
        self.threshold = 2**64
        self.size = 0
        self.count = 0  # documents kept so far: the next one's index

    def _push(self, h: int, index: int, text: str) -> None:
        heapq.heappush(self.heap, (-h, index, text))
        self.size += len(text)
        while self.size > self.budget and self.heap:
            neg, _, dropped = heapq.heappop(self.heap)
            self.size -= len(dropped)
            self.threshold = -neg

    def add(self, scanned: Scanned, record: _Record) -> None:
        texts = dict(scanned.candidates)
        kept = self.seen.first_seen(scanned.hashes)
        for index, j in enumerate(kept.tolist(), start=self.count):
            h = int(scanned.hashes[j])
            if h < self.threshold and j in texts:
                self._push(h, index, texts[j])
                record.pushed.append((h, index, texts[j]))
        self.count += len(kept)
        owners = np.full(len(kept), scanned.source, dtype=np.int16)
        self.owners.append(owners)
        row = np.zeros(len(COUNTS), dtype=np.int64)
        row[DOCS] = len(kept)
        row[DUPLICATES] = len(scanned.hashes) - len(kept)
        row[FILTERED] = scanned.filtered
        row[BAD] = scanned.bad
        row[TEXT_BYTES] = int(scanned.sizes[kept].sum()) if len(kept) else 0
        self.counts[scanned.source] += row
        record.counts[scanned.source] += row
        record.hashes.append(scanned.hashes[kept])
        record.owners.append(owners)
        record.units += 1

    def replay(self, saved: Any) -> None:
        """Take back a saved `_Record`, as the pass took it."""
        hashes = saved["hashes"]
        self.seen.add_all(hashes)
        self.owners.append(saved["owners"])
        self.counts += saved["counts"]
        text = saved["pushed_text"].tobytes()
        ends = np.cumsum(saved["pushed_lengths"]).tolist()
        for h, index, start, end in zip(
            saved["pushed_hashes"].tolist(), saved["pushed_index"].tolist(), [0, *ends[:-1]], ends
        ):
            self._push(h, index, text[start:end].decode("utf-8", "surrogatepass"))
        self.count += len(hashes)

    def totals(self) -> Totals:
        owners = np.concatenate(self.owners) if self.owners else np.zeros(0, dtype=np.int16)
        return Totals(self.counts.copy(), owners)

    def sample(self) -> dict[int, str]:
        return {index: text for _, index, text in self.heap}


def tokenize_parts(
    units: Iterable[Any],
    pool: Pool,
    parts: Path,
    units_per_part: int,
    vocab: int,
    num_sources: int,
    tick: Callable[[int, int], None],
    encoding: tuple[str, int, str],
) -> tuple[Totals, int]:
    """Tokenize the stream into parts (resuming after the complete ones); the totals and part count.
    `encoding`: (tokenizer.json, eos id, token dtype) for the workers."""
    parts.mkdir(parents=True, exist_ok=True)
    for stale in parts.glob(".*.tmp*"):  # what a killed run was writing
        stale.unlink(missing_ok=True)
    done = complete_parts(parts)
    totals = Totals(np.zeros((num_sources, len(COUNTS)), dtype=np.int64))
    seen = SeenHashes()
    for i in range(done):
        with np.load(parts / f"{part_name(i)}.npz") as saved:
            seen.add_all(saved["hashes"])
            totals.counts += saved["counts"]
    if (parts / PASS_DONE).is_file():
        return totals, done
    part = _Part(parts, done, vocab, num_sources)
    rest = itertools.islice(units, done * units_per_part, None)
    for enc in pool.map(encode_unit, rest, lambda: encoding):
        assert isinstance(enc, Encoded)
        part.add(enc, seen)
        tick(enc.text_bytes, int(enc.offsets[-1]))
        if part.units == units_per_part:
            totals.counts += part.close()
            part = _Part(parts, part.index + 1, vocab, num_sources)
    if part.units:
        totals.counts += part.close()
    else:
        part.abort()
    (parts / PASS_DONE).write_text("done\n")
    return totals, complete_parts(parts)


class _Part:
    """One part being written: its shard, and the hashes and sources of its documents."""

    def __init__(self, parts: Path, index: int, vocab: int, num_sources: int) -> None:
        self.path = parts / part_name(index)
        self.index = index
        self.writer = ShardWriter(self.path, vocab)
        self.hashes: list[np.ndarray] = []
        self.owners: list[np.ndarray] = []
        self.counts = np.zeros((num_sources, len(COUNTS)), dtype=np.int64)
        self.units = 0

    def add(self, enc: Encoded, seen: SeenHashes) -> None:
        """Append a unit's documents that are not duplicates of any document before them."""
        hashes = enc.hashes
        kept = seen.first_seen(hashes)
        keep = kept.tolist()
        if len(keep) == len(hashes):
            self.writer.add_documents(enc.tokens, enc.offsets)
        else:
            for j in keep:
                self.writer.add_document(enc.tokens[enc.offsets[j] : enc.offsets[j + 1]])
        self.hashes.append(enc.hashes[kept])
        self.owners.append(np.full(len(keep), enc.source, dtype=np.int16))
        row = self.counts[enc.source]
        row[DOCS] += len(keep)
        row[TOKENS] += int((enc.offsets[kept + 1] - enc.offsets[kept]).sum()) if len(keep) else 0
        row[DUPLICATES] += len(hashes) - len(keep)
        row[FILTERED] += enc.filtered
        row[BAD] += enc.bad
        row[TEXT_BYTES] += enc.text_bytes
        self.units += 1

    def close(self) -> np.ndarray:
        self.writer.close()
        hashes = np.concatenate(self.hashes) if self.hashes else np.zeros(0, dtype=np.uint64)
        owners = np.concatenate(self.owners) if self.owners else np.zeros(0, dtype=np.int16)
        _save_npz(self.path.with_suffix(".npz"), hashes=hashes, owners=owners, counts=self.counts)
        return self.counts

    def abort(self) -> None:
        self.writer.abort()


def load_owners(parts: Path, num_parts: int) -> np.ndarray:
    """The source of every document, in stream order."""
    owners = []
    for i in range(num_parts):
        with np.load(parts / f"{part_name(i)}.npz") as saved:
            owners.append(saved["owners"])
    return np.concatenate(owners) if owners else np.zeros(0, dtype=np.int16)


def split_documents(num_docs: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val document ids (sorted); at least one of each."""
    num_val = min(max(1, round(val_fraction * num_docs)), num_docs - 1)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(num_docs)
    return np.sort(perm[num_val:]), np.sort(perm[:num_val])


def training_order(train_ids: np.ndarray, owners: np.ndarray, num_sources: int) -> np.ndarray:
    """The training documents, shuffled; with several sources, grouped by source (each shuffled), so
    the loader can draw each source's windows from its own range of train.bin."""
    order = train_ids[np.random.default_rng(_ORDER_SEED).permutation(len(train_ids))]
    if num_sources > 1:
        order = order[np.argsort(owners[order], kind="stable")]
    return order


def check_documents(num_docs: int) -> None:
    if num_docs < 2:
        raise ConfigError(
            f"data.sources hold {num_docs} non-empty document(s); a train/val split needs at least 2 — add text"
        )


def assemble(
    parts: Path, num_parts: int, out: Path, vocab: int, val_fraction: float, num_sources: int, chunk: int
) -> dict[str, Any]:
    """train.bin/.idx and val.bin/.idx under `out` from the parts; document and token counts, and each
    source's [start, end) token range in train.bin. Resumable: every `chunk` bytes of a split written
    are made durable and recorded, and a rerun continues there (a finished split is kept)."""
    owners = load_owners(parts, num_parts)
    check_documents(len(owners))
    train_ids, val_ids = split_documents(len(owners), val_fraction)
    order = training_order(train_ids, owners, num_sources)
    shards = [IndexedTokens(parts / part_name(i)) for i in range(num_parts)]
    lengths = np.concatenate([np.diff(s.offsets) for s in shards])
    starts = np.concatenate([s.offsets[:-1] for s in shards])
    doc_part = np.repeat(np.arange(num_parts), [s.num_docs for s in shards])
    files = [os.open(s.bin_path, os.O_RDONLY) for s in shards]
    dtype = dtype_for(vocab)
    result: dict[str, Any] = {}
    try:
        for split, ids in (("train", order), ("val", val_ids)):
            offsets = np.zeros(len(ids) + 1, dtype=np.int64)
            np.cumsum(lengths[ids], out=offsets[1:])
            ranges = np.zeros((num_sources, 2), dtype=np.int64)
            where = owners[ids]
            for source in range(num_sources):
                mine = np.flatnonzero(where == source)
                if len(mine):
                    ranges[source] = offsets[mine[0]], offsets[mine[-1] + 1]
            _gather(
                out / split,
                offsets,
                dtype,
                partial(_documents, ids, doc_part, starts, lengths, files, dtype),
                chunk,
            )
            result[split] = {"docs": len(ids), "tokens": int(offsets[-1]), "ranges": ranges.tolist()}
    finally:
        for fd in files:
            os.close(fd)
        del shards
    return result


def _documents(
    ids: np.ndarray,
    doc_part: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    files: list[int],
    dtype: np.dtype,
    begin: int,
) -> Iterator[bytes]:
    """The tokens of documents `ids[begin:]` in turn, read from the parts' files (positioned reads);
    `starts`: each document's first token in its part."""
    chosen = ids[begin:]
    size = dtype.itemsize
    for part, start, n in zip(doc_part[chosen].tolist(), starts[chosen].tolist(), lengths[chosen].tolist()):
        yield os.pread(files[part], n * size, start * size)


def _gather(
    prefix: Path,
    offsets: np.ndarray,
    dtype: np.dtype,
    documents: Callable[[int], Iterator[bytes]],
    chunk: int,
) -> None:
    """Write `<prefix>.bin/.idx`: the documents `documents(0)` yields (their token `offsets` known ahead).

    The tokens go to a `.partial` file; after every `chunk` bytes it is flushed to disk and the count
    of documents written is recorded (`.done`), so a rerun cuts the file there and continues from
    `documents(count)`; the final names appear when the split is complete (the .idx last: a split
    with its .idx is done)."""
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if idx_path.is_file():
        return
    partial_bin = prefix.with_name(f".{prefix.name}.bin.partial")
    mark = prefix.with_name(f".{prefix.name}.bin.done")
    total = int(offsets[-1]) * dtype.itemsize
    if not (bin_path.is_file() and bin_path.stat().st_size == total):  # else only its .idx was missing
        start = int(mark.read_text()) if mark.is_file() and partial_bin.is_file() else 0
        if start and partial_bin.stat().st_size < int(offsets[start]) * dtype.itemsize:
            start = 0  # shorter than recorded (a crash of the machine, not of the run): start over
        with open(partial_bin, "r+b" if start else "wb") as f:
            f.truncate(int(offsets[start]) * dtype.itemsize)
            f.seek(0, os.SEEK_END)
            written = f.tell()
            for i, raw in enumerate(documents(start), start=start):
                f.write(raw)
                if f.tell() - written >= chunk:
                    _durable(f, mark, i + 1)
                    written = f.tell()
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial_bin, bin_path)
    tmp = idx_path.with_name(f".{idx_path.name}.tmp")
    write_index(tmp, dtype, offsets)
    os.replace(tmp, idx_path)
    mark.unlink(missing_ok=True)


def _durable(f: Any, mark: Path, docs: int) -> None:
    """Flush `f` to disk, then record that its first `docs` documents are there."""
    f.flush()
    os.fsync(f.fileno())
    tmp = mark.with_name(f"{mark.name}.tmp")
    tmp.write_text(str(docs))
    os.replace(tmp, mark)
