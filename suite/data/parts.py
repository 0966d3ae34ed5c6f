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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from suite.config.errors import ConfigError
from suite.data.seen import SeenHashes
from suite.data.shards import IndexedTokens, ShardWriter, dtype_for
from suite.data.workers import Encoded, Pool, Scanned, encode_unit, scan_unit

# columns of the per-source counts
DOCS, TOKENS, DUPLICATES, FILTERED, BAD, TEXT_BYTES = range(6)
COUNTS = ("documents", "tokens", "duplicates", "filtered", "bad_records", "text_bytes")
_SPLIT_SEED, _ORDER_SEED = 20240501, 20240503


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
    units: Iterable[Any], pool: Pool, budget: int, num_sources: int, tick: Callable[[int, int], None]
) -> tuple[Totals, dict[int, str]]:
    """Every document's source, and the tokenizer sample {document index: text} (train and val)."""
    totals = Totals(np.zeros((num_sources, len(COUNTS)), dtype=np.int64))
    seen = SeenHashes()
    owners: list[np.ndarray] = []
    heap: list[tuple[int, int, str]] = []  # (-hash, index, text): the largest hash on top
    state = {"threshold": 2**64, "size": 0, "count": 0}
    for scanned in pool.map(scan_unit, units, lambda: (state["threshold"],)):
        assert isinstance(scanned, Scanned)
        texts = dict(scanned.candidates)
        kept = seen.first_seen(scanned.hashes).tolist()
        totals.add(scanned.source, DUPLICATES, len(scanned.hashes) - len(kept))
        for index, j in enumerate(kept, start=state["count"]):
            h = int(scanned.hashes[j])
            if h < state["threshold"] and j in texts:
                heapq.heappush(heap, (-h, index, texts[j]))
                state["size"] += len(texts[j])
                while state["size"] > budget and heap:
                    neg, _, text = heapq.heappop(heap)
                    state["size"] -= len(text)
                    state["threshold"] = -neg
        state["count"] += len(kept)
        owners.append(np.full(len(kept), scanned.source, dtype=np.int16))
        totals.add(scanned.source, DOCS, len(kept))
        totals.add(scanned.source, FILTERED, scanned.filtered)
        totals.add(scanned.source, BAD, scanned.bad)
        totals.add(scanned.source, TEXT_BYTES, int(scanned.sizes[kept].sum()) if kept else 0)
        tick(scanned.text_bytes, 0)
    totals.owners = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int16)
    return totals, {index: text for _, index, text in heap}


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
    parts: Path, num_parts: int, out: Path, vocab: int, val_fraction: float, num_sources: int
) -> dict[str, Any]:
    """train.bin/.idx and val.bin/.idx under `out` from the parts; document and token counts, and each
    source's [start, end) token range in train.bin."""
    owners = load_owners(parts, num_parts)
    check_documents(len(owners))
    train_ids, val_ids = split_documents(len(owners), val_fraction)
    order = training_order(train_ids, owners, num_sources)
    shards = [IndexedTokens(parts / part_name(i)) for i in range(num_parts)]
    bases = np.cumsum([0] + [s.num_docs for s in shards])
    files = [os.open(s.bin_path, os.O_RDONLY) for s in shards]
    itemsize = dtype_for(vocab).itemsize
    result: dict[str, Any] = {}
    try:
        for split, ids in (("train", order), ("val", val_ids)):
            ranges = np.zeros((num_sources, 2), dtype=np.int64)
            with ShardWriter(out / split, vocab) as writer:
                where = np.searchsorted(bases, ids, side="right") - 1
                for doc, p in zip(ids.tolist(), where.tolist()):
                    local = doc - int(bases[p])
                    start, end = int(shards[p].offsets[local]), int(shards[p].offsets[local + 1])
                    raw = os.pread(files[p], (end - start) * itemsize, start * itemsize)
                    source = int(owners[doc])
                    if not ranges[source].any():
                        ranges[source, 0] = writer.num_tokens
                    writer.add_documents(
                        np.frombuffer(raw, dtype=shards[p].dtype), np.array([0, end - start])
                    )
                    ranges[source, 1] = writer.num_tokens
            result[split] = {"docs": writer.num_docs, "tokens": writer.num_tokens, "ranges": ranges.tolist()}
    finally:
        for fd in files:
            os.close(fd)
        del shards
    return result
