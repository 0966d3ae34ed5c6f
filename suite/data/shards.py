"""Megatron-style indexed token shards: a flat token file plus a small document index.

`<prefix>.bin` holds every token back to back (uint16 when the vocabulary fits, else uint32) so
training reads it through a read-only memmap without loading it. `<prefix>.idx` is:

    header  (32 bytes, little-endian): magic b"SUITEIDX", version u32, dtype code u32,
            num_docs i64, num_tokens i64
    offsets (num_docs + 1) x int64: document i is tokens[offsets[i]:offsets[i+1]]
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from suite.config.errors import ConfigError

MAGIC = b"SUITEIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIqq")
DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id of the vocabulary."""
    return DTYPES[1] if vocab_size <= 65536 else DTYPES[2]


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def write_index(path: Path, dtype: np.dtype, offsets: np.ndarray) -> None:
    """Write `<prefix>.idx` for documents at `offsets` (int64, from 0) of tokens of `dtype`."""
    code = next(c for c, d in DTYPES.items() if d == dtype)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, code, len(offsets) - 1, int(offsets[-1])))
        np.asarray(offsets, dtype=np.int64).astype("<i8", copy=False).tofile(f)


class ShardWriter:
    """Appends documents to `<prefix>.bin/.idx`; nothing appears under the final names until close()."""

    def __init__(self, prefix: str | Path, vocab_size: int) -> None:
        self.bin_path, self.idx_path = _paths(prefix)
        self.vocab_size = vocab_size
        self.dtype = dtype_for(vocab_size)
        self._tmp_bin = self.bin_path.with_name(f".{self.bin_path.name}.tmp-{os.getpid()}")
        self._tmp_idx = self.idx_path.with_name(f".{self.idx_path.name}.tmp-{os.getpid()}")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._offsets = array("q", [0])  # 8 bytes a document, not a Python int each

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) in document {self.num_docs}")
        arr.astype(self.dtype, copy=False).tofile(self._file)
        self._offsets.append(self._offsets[-1] + int(arr.size))

    def add_documents(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        """Append many documents at once: document i is tokens[offsets[i]:offsets[i+1]] (offsets from 0)."""
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) after document {self.num_docs}")
        tokens.astype(self.dtype, copy=False).tofile(self._file)
        base = self._offsets[-1]
        self._offsets.extend((np.asarray(offsets[1:], dtype=np.int64) + base).tolist())

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def close(self) -> None:
        """Flush both files and move them under their final names."""
        if self._file.closed:
            return
        self._file.close()
        write_index(self._tmp_idx, self.dtype, np.frombuffer(self._offsets, dtype=np.int64))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def abort(self) -> None:
        """Drop everything written so far."""
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class IndexedTokens:
    """A read-only, memory-mapped view of a shard pair, validated on open."""

    def __init__(self, prefix: str | Path) -> None:
        self.bin_path, self.idx_path = _paths(prefix)
        hint = "re-run `suite prepare` to rebuild it"
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise ConfigError(f"token shard '{path}' is missing; {hint}")
        raw = self.idx_path.read_bytes()
        if len(raw) < HEADER.size:
            raise ConfigError(f"token index '{self.idx_path}' is truncated ({len(raw)} bytes); {hint}")
        magic, version, code, num_docs, num_tokens = HEADER.unpack_from(raw)
        if magic != MAGIC or code not in DTYPES or num_docs < 0 or num_tokens < 0:
            raise ConfigError(
                f"token index '{self.idx_path}' is not a suite shard index (bad header); {hint}"
            )
        if version != VERSION:
            raise ConfigError(
                f"token index '{self.idx_path}' has format version {version}, this suite reads {VERSION}; {hint}"
            )
        expected = HEADER.size + 8 * (num_docs + 1)
        if len(raw) != expected:
            raise ConfigError(
                f"token index '{self.idx_path}' is {len(raw)} bytes, expected {expected}; it is corrupt, {hint}"
            )
        offsets = np.frombuffer(raw, dtype="<i8", offset=HEADER.size)
        if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) < 0):
            raise ConfigError(f"token index '{self.idx_path}' has inconsistent offsets; {hint}")
        self.dtype = DTYPES[code]
        size = self.bin_path.stat().st_size
        if size != num_tokens * self.dtype.itemsize:
            raise ConfigError(
                f"token shard '{self.bin_path}' is {size} bytes but its index promises {num_tokens} tokens "
                f"({num_tokens * self.dtype.itemsize} bytes); the file is truncated or corrupt, {hint}"
            )
        self.offsets = offsets
        self.num_docs = int(num_docs)
        self.num_tokens = int(num_tokens)
        if num_tokens:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        else:  # numpy cannot map an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)

    def document(self, i: int) -> np.ndarray:
        """The token ids of document i (a view into the memmap)."""
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents")
        i %= self.num_docs
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def __len__(self) -> int:
        return self.num_docs
