"""The one global-batch sampler: a seeded order of samples, sliced per data-parallel rank.

Every optimizer step consumes the next `global_batch_size` samples of that epoch's permutation
(seed + epoch); data-parallel rank r takes the contiguous r-th slice and cuts it into micro-batches
in order. The samples of a step therefore depend on neither dp nor the micro-batch size, which is
what makes dp=1 x 2 micro-batches equal dp=2 x 1 micro-batch. The partial global batch at the end
of an epoch is dropped. Pretraining windows (suite.data.loader.TokenWindows) and SFT rows
(suite.data.sft.SFTDataset) are both `SampleSource`s: anything with a length, a `seq_len` and
`batch(indices) -> Batch`.

Overlap with compute (`prefetch=True`, data.prefetch; on by default on accelerators): while the
device runs step n, a background thread gathers step n+1's rows and, with `pin_memory=True`,
copies them into page-locked memory, so the step's `batch.to(device, non_blocking=True)` is an
asynchronous copy. Batches are a pure function of (epoch, position), so prefetching changes no
batch and no `state_dict()`: resume stays exact.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from suite.config.errors import ConfigError
from suite.data.batch import Batch


class SampleSource(Protocol):
    """What the sampler draws from: `len()` samples of `seq_len` positions each."""

    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> Batch: ...

    def too_small(self, global_batch_size: int, split: str) -> str:
        """The one-line error when the source holds less than one global batch."""
        ...

    def resume_mismatch(self, saved_samples: int) -> str | None:
        """A one-line error when a checkpoint's sample count says the data changed (None: accept)."""
        ...


class GlobalBatches:
    """Step-at-a-time micro-batches for one data-parallel rank, with exact resume via state_dict()."""

    def __init__(
        self,
        source: SampleSource,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        split: str = "train",
        prefetch: bool = False,
        pin_memory: bool = False,
    ) -> None:
        check_batch_shapes(source.seq_len, micro_batch_size, global_batch_size, dp_rank, dp_size)
        if len(source) < global_batch_size:
            raise ConfigError(source.too_small(global_batch_size, split))
        self.source = source
        self.split = split
        self.seq_len = source.seq_len
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = global_batch_size // dp_size
        self.seed = seed
        self.num_samples = len(source)
        self.steps_per_epoch = self.num_samples // global_batch_size
        self.epoch = 0
        self.position = 0  # optimizer steps already taken in this epoch
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)
        self.pin_memory = pin_memory
        self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._prefetched: tuple[tuple[int, int], Future] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if getattr(self.source, "self_ordered", False):  # a mixture: absolute sample numbers
                self._order = epoch * self.num_samples + np.arange(self.num_samples, dtype=np.int64)
            else:
                self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def _rank_micro_batches(self, step_samples: np.ndarray) -> list[Batch]:
        """This rank's slice of one step's samples, cut into micro-batches in order."""
        mine = step_samples[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]
        batches = [
            self.source.batch(mine[i : i + self.micro_batch_size])
            for i in range(0, len(mine), self.micro_batch_size)
        ]
        if self.pin_memory:  # page-locked: the copy to the device can be asynchronous
            batches = [b.pin_memory() for b in batches]
        return batches

    def _step_batches(self, order: np.ndarray, position: int) -> list[Batch]:
        """The micro-batches at `position` of an epoch's sample order (no state is read or changed)."""
        g = self.global_batch_size
        return self._rank_micro_batches(order[position * g : (position + 1) * g])

    def _following(self, epoch: int, position: int) -> tuple[int, int]:
        """The (epoch, position) the next call of next_step reads, from the state (epoch, position)."""
        return (epoch + 1, 0) if position >= self.steps_per_epoch else (epoch, position)

    def next_step(self) -> list[Batch]:
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

    def eval_batches(self, num_batches: int | None = None) -> list[Batch]:
        """This rank's part of the first `num_batches` global batches in sample order, no shuffle
        (None: all of them). Capped at what the split holds, so a small split still evaluates."""
        g = self.global_batch_size
        count = self.steps_per_epoch if num_batches is None else min(num_batches, self.steps_per_epoch)
        batches: list[Batch] = []
        for step in range(count):
            batches.extend(self._rank_micro_batches(np.arange(step * g, (step + 1) * g, dtype=np.int64)))
        return batches

    def eval_rows(self, num_rows: int | None = None) -> list[Batch]:
        """This rank's contiguous 1/dp of the split's first `num_rows` samples in order (None: all of
        them), in micro-batches: every data-parallel degree evaluates the same rows, so `val_loss` does
        not depend on the layout. Rounded up to a multiple of the data ranks (each must run as many
        forwards: FSDP and tp gather inside them) and capped at the split's whole micro-batches."""
        ranks, mb = self.dp_size, self.micro_batch_size
        held = self.num_samples - self.num_samples % mb  # whole micro-batches, as one process reads them
        rows = held if num_rows is None else min(num_rows, held)
        rows = -(-rows // ranks) * ranks
        if rows > held:
            rows = held - held % ranks
        share = rows // ranks
        mine = np.arange(self.dp_rank * share, (self.dp_rank + 1) * share, dtype=np.int64)
        batches = [self.source.batch(mine[i : i + mb]) for i in range(0, share, mb)]
        if self.pin_memory:
            batches = [b.pin_memory() for b in batches]
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` left off (same data, seed and global batch size)."""
        saved = state.get("num_samples", state.get("num_rows"))  # num_rows: SFT checkpoints before the merge
        problem = None if saved is None else self.source.resume_mismatch(int(saved))
        if problem:
            raise ConfigError(problem)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._prefetched = None  # keyed by (epoch, position) anyway; drop the stale one now

    def tokens_by_source(self) -> list[int] | None:
        """Tokens every rank together drew from each source of a mixture over the run so far (resumed
        runs included: from the state, not a count of batches), or None for a single stream."""
        drawn = getattr(self.source, "drawn", None)
        if drawn is None:
            return None
        used = self.steps_per_epoch * self.global_batch_size  # an epoch's samples that fill a step
        spans = [(e * self.num_samples, e * self.num_samples + used) for e in range(self.epoch)]
        spans.append(
            (
                self.epoch * self.num_samples,
                self.epoch * self.num_samples + self.position * self.global_batch_size,
            )
        )
        return drawn(spans)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def check_batch_shapes(seq_len: int, micro: int, global_: int, dp_rank: int, dp_size: int) -> None:
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
