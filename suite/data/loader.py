"""Training batches: fixed token windows, one seeded global order shared by every rank.

Sample k is tokens[k*seq_len : k*seq_len + seq_len + 1] of the split's concatenated stream (inputs
and shifted targets in one tensor). Each optimizer step consumes the next `global_batch_size`
samples of that epoch's permutation; data-parallel rank r takes the contiguous r-th slice and cuts
it into micro-batches in order. The samples of a step therefore do not depend on dp or on the
micro-batch size, which is what makes dp=1 x 2 micro-batches equal dp=2 x 1 micro-batch.

Overlap with compute (`prefetch=True`, data.prefetch; on by default on accelerators): while the
device runs step n, a background thread gathers step n+1's rows from the memmap and, with
`pin_memory=True`, copies them into page-locked memory, so the trainer's
`batch.to(device, non_blocking=True)` is an asynchronous copy that does not stall the host. The
batches are a pure function of (epoch, position), so prefetching changes no batch and no
`state_dict()`: resume stays exact.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from suite.config.errors import ConfigError
from suite.data.shards import IndexedTokens


class TokenBatches:
    """Step-at-a-time batches for one data-parallel rank, with exact resume via state_dict()."""

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
    ) -> None:
        path = Path(prefix_or_dir).expanduser()
        self.data = IndexedTokens(path / split if path.is_dir() else path)
        self.split = split
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        _check_shapes(seq_len, micro_batch_size, global_batch_size, dp_rank, dp_size)
        self.per_rank = global_batch_size // dp_size
        self.num_samples = max(0, (self.data.num_tokens - 1) // seq_len)
        if self.num_samples < global_batch_size:
            need = global_batch_size * seq_len + 1
            raise ConfigError(
                f"the {split} split holds {self.data.num_tokens:,} tokens, fewer than one global batch needs "
                f"(parallel.global_batch_size={global_batch_size} x data.seq_len={seq_len} + 1 = {need:,}); "
                "lower data.seq_len or parallel.global_batch_size, or prepare more text"
            )
        self.steps_per_epoch = self.num_samples // global_batch_size
        self.epoch = 0
        self.position = 0  # optimizer steps already taken in this epoch
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)
        self._window = np.arange(seq_len + 1, dtype=np.int64)
        self.pin_memory = pin_memory
        self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._prefetched: tuple[tuple[int, int], Future] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def _rank_micro_batches(self, step_samples: np.ndarray) -> list[torch.Tensor]:
        """This rank's slice of one step's samples, as int64 [micro_batch_size, seq_len + 1] tensors."""
        mine = step_samples[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
        rows = self.data.tokens[mine[:, None] * self.seq_len + self._window]  # gathers from the memmap
        rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        if self.pin_memory:
            rows = rows.pin_memory()  # page-locked: the copy to the device can be asynchronous
        return list(rows.split(self.micro_batch_size))

    def _step_batches(self, order: np.ndarray, position: int) -> list[torch.Tensor]:
        """The micro-batches at `position` of an epoch's sample order (no state is read or changed)."""
        g = self.global_batch_size
        return self._rank_micro_batches(order[position * g : (position + 1) * g])

    def _following(self, epoch: int, position: int) -> tuple[int, int]:
        """The (epoch, position) the next call of next_step reads, from the state (epoch, position)."""
        return (epoch + 1, 0) if position >= self.steps_per_epoch else (epoch, position)

    def next_step(self) -> list[torch.Tensor]:
        """The micro-batches this rank processes for the next optimizer step."""
        key = self._following(self.epoch, self.position)
        self.epoch, position = key
        self.position = position + 1
        ready, self._prefetched = self._prefetched, None
        if ready is not None and ready[0] == key:
            batches = ready[1].result()
        else:
            batches = self._step_batches(self._permutation(self.epoch), position)
        if self._prefetch_pool is not None:  # gather the step after this one while it computes
            upcoming = self._following(self.epoch, self.position)
            order = self._permutation(upcoming[0])  # computed here: the thread only reads its own
            self._prefetched = (upcoming, self._prefetch_pool.submit(self._step_batches, order, upcoming[1]))
        return batches

    def eval_batches(self, num_batches: int) -> list[torch.Tensor]:
        """The first `num_batches` global batches of the split in stream order (no shuffle), this rank's part.

        Capped at what the split holds, so a small validation split still evaluates.
        """
        g = self.global_batch_size
        batches: list[torch.Tensor] = []
        for step in range(min(num_batches, self.steps_per_epoch)):
            batches.extend(self._rank_micro_batches(np.arange(step * g, (step + 1) * g, dtype=np.int64)))
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` left off (same data, seed and global batch size assumed)."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._prefetched = None  # keyed by (epoch, position) anyway; drop the stale one now

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def _check_shapes(seq_len: int, micro: int, global_: int, dp_rank: int, dp_size: int) -> None:
    if seq_len < 1:
        raise ConfigError(f"data.seq_len={seq_len} must be >= 1; e.g. 256")
    if micro < 1 or global_ < 1:
        raise ConfigError(
            f"parallel.micro_batch_size={micro} and parallel.global_batch_size={global_} must be >= 1"
        )
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    if global_ % (dp_size * micro):
        raise ConfigError(
            f"parallel.global_batch_size={global_} must be a multiple of data-parallel size ({dp_size}) x "
            f"parallel.micro_batch_size={micro} = {dp_size * micro}; e.g. "
            f"parallel.global_batch_size={max(1, global_ // (dp_size * micro)) * dp_size * micro}"
        )
