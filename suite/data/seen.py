"""The content hashes `suite prepare` has seen, in 8 bytes each rather than a Python set's ~70.

The exact-duplicate check meets every document of the corpus once, so this is the one structure that
grows with the corpus: a sorted uint64 array (looked up with `np.searchsorted`) and a small set of
the newest hashes, merged into the array when it reaches an eighth of it (at most 2**20), so a
merge's linear cost is spread over many documents. 100 M documents take about 0.8 GB, not 7 GB.
"""

from __future__ import annotations

import numpy as np

_MIN_RECENT, _MAX_RECENT = 1 << 16, 1 << 20


class SeenHashes:
    """A set of uint64 content hashes with a batch `first_seen` check."""

    def __init__(self) -> None:
        self._sorted = np.zeros(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, h: int) -> bool:
        return h in self._recent or bool(self._member(np.asarray([h], dtype=np.uint64))[0])

    def add_all(self, hashes: np.ndarray) -> None:
        """Add hashes known to be distinct from each other and from those held (a resumed run's)."""
        self._insert(np.asarray(hashes, dtype=np.uint64))

    def first_seen(self, hashes: np.ndarray) -> np.ndarray:
        """The positions (int64) of `hashes` not seen before, nor earlier in `hashes`; all are added."""
        old = self._member(np.asarray(hashes, dtype=np.uint64)).tolist()
        keep = []
        recent = self._recent
        for j, (h, was) in enumerate(zip(hashes.tolist(), old)):
            if not was and h not in recent:
                recent.add(h)
                keep.append(j)
        if len(recent) >= max(_MIN_RECENT, min(len(self._sorted) // 8, _MAX_RECENT)):
            self._insert(np.fromiter(recent, dtype=np.uint64, count=len(recent)))
            recent.clear()
        return np.asarray(keep, dtype=np.int64)

    def _member(self, hashes: np.ndarray) -> np.ndarray:
        if not len(self._sorted):
            return np.zeros(len(hashes), dtype=bool)
        at = np.searchsorted(self._sorted, hashes)
        return self._sorted[np.minimum(at, len(self._sorted) - 1)] == hashes

    def _insert(self, new: np.ndarray) -> None:
        new = np.sort(new)
        self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, new), new)
