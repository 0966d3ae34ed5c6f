"""A mixture of sources by exact token shares: `data.sources[i].weight` is the share of training
tokens drawn from source i (normalised over the sources), not a share of documents.

`suite prepare` writes each source's training documents together in train.bin (meta.json's
`train_ranges`). Training samples are fixed windows cut inside one source's range. Samples are
assigned to sources by a fixed schedule of CYCLE slots: source s gets round(share_s x CYCLE) slots
(largest remainders), spread evenly through the cycle, so any run of samples holds each source's
share to within a sample or two, and the per-source counts are exact every cycle. Within a source,
its k-th sample is window perm_e[k mod W] of its W windows, where e = k div W is the source's own
epoch and perm_e a permutation seeded by (seed, source, e): a small source is upsampled (cycled in
a fresh order), a large one is read part way. Sample j -> window is a pure function of j, so the
sampler's (epoch, position) resume stays exact and prefetching changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from suite.config.errors import ConfigError
from suite.data.batch import Batch
from suite.data.shards import IndexedTokens

CYCLE = 4096  # mixture slots per cycle: shares are exact to 1/CYCLE


def schedule(shares: np.ndarray, cycle: int = CYCLE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source of each slot, the slot's rank within its source, slots per source) for one cycle."""
    exact = shares / shares.sum() * cycle
    counts = np.floor(exact).astype(np.int64)
    short = cycle - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    ideal = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n])
    owner = np.concatenate([np.full(n, s, dtype=np.int64) for s, n in enumerate(counts) if n])
    rank = np.concatenate([np.arange(n, dtype=np.int64) for n in counts if n])
    order = np.argsort(ideal, kind="stable")
    return owner[order], rank[order], counts


class MixtureWindows:
    """The training windows of a prepared mixture, as a sample source for GlobalBatches. The sampler
    hands it absolute sample numbers (`self_ordered`) and it does its own seeded shuffling."""

    self_ordered = True

    def __init__(
        self,
        folder: str | Path,
        ranges: list[list[int]],
        shares: list[float],
        seq_len: int,
        eos_id: int | None = None,
        seed: int = 0,
    ) -> None:
        self.data = IndexedTokens(Path(folder) / "train")
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.seed = seed
        self.starts = np.asarray([start for start, _ in ranges], dtype=np.int64)
        lengths = np.asarray([end - start for start, end in ranges], dtype=np.int64)
        self.windows = np.maximum(0, (lengths - 1) // seq_len) if seq_len > 0 else lengths * 0
        empty = [i for i, w in enumerate(self.windows) if w == 0]
        if empty:
            raise ConfigError(
                f"data.sources[{empty[0]}] holds fewer than data.seq_len + 1 = {seq_len + 1} training tokens; "
                "lower data.seq_len, add text to it, or drop the source"
            )
        self.owner, self.rank, self.per_cycle = schedule(np.asarray(shares, dtype=np.float64))
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.windows.sum())

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) >= 8:
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, source, epoch])
            self._perms[key] = rng.permutation(int(self.windows[source]))
        return self._perms[key]

    def starts_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, first token in train.bin) of each absolute sample number."""
        samples = np.asarray(samples, dtype=np.int64)
        cycle, slot = np.divmod(samples, CYCLE)
        source = self.owner[slot]
        k = cycle * self.per_cycle[source] + self.rank[slot]
        epoch, within = np.divmod(k, self.windows[source])
        window = np.asarray([self._perm(int(s), int(e))[int(w)] for s, e, w in zip(source, epoch, within)])
        return source, self.starts[source] + window.astype(np.int64) * self.seq_len

    def samples_below(self, n: int) -> np.ndarray:
        """How many of the samples 0..n-1 each source gives (the schedule's whole cycles, then the
        slots of the last one): the realised shares of any run, exact without counting batches."""
        cycles, rest = divmod(int(n), CYCLE)
        return cycles * self.per_cycle + np.bincount(self.owner[:rest], minlength=len(self.per_cycle))

    def drawn(self, spans: list[tuple[int, int]]) -> list[int]:
        """Tokens drawn from each source by the samples in the [start, end) `spans` (all ranks)."""
        samples = sum(
            (self.samples_below(b) - self.samples_below(a) for a, b in spans), np.zeros(1, np.int64)
        )
        return [int(n) * self.seq_len for n in samples]

    def batch(self, indices: np.ndarray) -> Batch:
        _, starts = self.starts_of(indices)
        rows = self.data.tokens[starts[:, None] + self._window]
        return Batch.from_windows(torch.from_numpy(np.asarray(rows, dtype=np.int64)), self.eos_id)

    def too_small(self, global_batch_size: int, split: str) -> str:
        return (
            f"the {split} split holds {len(self)} windows of data.seq_len={self.seq_len} over its sources, fewer "
            f"than one global batch (parallel.global_batch_size={global_batch_size}); lower data.seq_len or "
            "parallel.global_batch_size, or prepare more text"
        )

    def resume_mismatch(self, saved_samples: int) -> str | None:
        return None
