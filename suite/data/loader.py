"""Pretraining samples: fixed token windows of the prepared stream, drawn by the one sampler.

Sample k is tokens[k*seq_len : k*seq_len + seq_len + 1] of the split's concatenated stream (inputs
and shifted targets in one window), made into a `Batch` (every position a target; with data.doc_mask,
positions and attention restart at every EOS). `TokenBatches` is suite.data.sampler.GlobalBatches
over these windows: the order, the data-parallel slicing, prefetching and resume live there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from suite.data.batch import Batch
from suite.data.mixture import MixtureWindows
from suite.data.sampler import GlobalBatches
from suite.data.shards import IndexedTokens


class TokenWindows:
    """The windows of one prepared split, as a sample source for GlobalBatches."""

    def __init__(self, prefix_or_dir: str | Path, split: str, seq_len: int, eos_id: int | None = None):
        path = Path(prefix_or_dir).expanduser()
        self.data = IndexedTokens(path / split if path.is_dir() else path)
        self.seq_len = seq_len
        self.eos_id = eos_id
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return max(0, (self.data.num_tokens - 1) // self.seq_len) if self.seq_len > 0 else 0

    def batch(self, indices: np.ndarray) -> Batch:
        rows = self.data.tokens[
            np.asarray(indices)[:, None] * self.seq_len + self._window
        ]  # gathers from the memmap
        return Batch.from_windows(torch.from_numpy(np.asarray(rows, dtype=np.int64)), self.eos_id)

    def too_small(self, global_batch_size: int, split: str) -> str:
        need = global_batch_size * self.seq_len + 1
        return (
            f"the {split} split holds {self.data.num_tokens:,} tokens, fewer than one global batch needs "
            f"(parallel.global_batch_size={global_batch_size} x data.seq_len={self.seq_len} + 1 = {need:,}); "
            "lower data.seq_len or parallel.global_batch_size, or prepare more text"
        )

    def resume_mismatch(self, saved_samples: int) -> str | None:
        return None  # a grown or shrunk corpus resumes at the same (epoch, position)


def _windows(
    prefix_or_dir: str | Path, split: str, seq_len: int, eos_id: int | None, seed: int
) -> TokenWindows | MixtureWindows:
    """A prepared mixture's training split draws by token share (suite.data.mixture); anything else
    is one stream of windows."""
    folder = Path(prefix_or_dir).expanduser()
    meta_file = folder / "meta.json"
    if split == "train" and folder.is_dir() and meta_file.is_file():
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("train_ranges") and len(meta["train_ranges"]) > 1:
            shares = [float(s["weight"]) for s in meta["sources"]]
            return MixtureWindows(folder, meta["train_ranges"], shares, seq_len, eos_id, seed)
    return TokenWindows(prefix_or_dir, split, seq_len, eos_id)


class TokenBatches(GlobalBatches):
    """GlobalBatches over the token windows of `split` under `prefix_or_dir`."""

    def __init__(
        self,
        prefix_or_dir: str | Path,
        split: str,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        prefetch: bool = False,
        pin_memory: bool = False,
        eos_id: int | None = None,
    ) -> None:
        super().__init__(
            _windows(prefix_or_dir, split, seq_len, eos_id, seed),
            micro_batch_size,
            global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            split=split,
            prefetch=prefetch,
            pin_memory=pin_memory,
        )
        self.data = self.source.data
