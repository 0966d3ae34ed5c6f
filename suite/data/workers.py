"""`suite prepare`'s tokenization workers: units of text in, token arrays out, in the order sent.

Each worker process parses its unit (suite.data.streams.unit_texts), hashes every kept document
(the exact-duplicate check is the parent's, so it sees documents in stream order) and encodes them
with the tokenizer's own single-threaded `encode_batch`. The parent keeps a bounded number of units
in flight and takes results strictly in submission order, so the output is the same for any number
of workers and memory stays at a few units per worker. Workers are spawned (no fork of a parent
that may hold threads) and leave on their own when the parent dies (a SIGKILLed prepare leaves no
orphans behind to hold memory).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from suite.config.errors import ConfigError
from suite.data.streams import Unit, unit_texts

_PARALLELISM = "TOKENIZERS_PARALLELISM"
# set while a Pool lives: where a worker that finds itself re-running the caller's script says so
_UNGUARDED_FILE = "SUITE_PREPARE_UNGUARDED_FILE"
_state: dict[str, Any] = {}


@dataclass
class Encoded:
    """One unit's kept documents: content hashes, and tokens (EOS after each) with offsets."""

    source: int
    hashes: np.ndarray  # uint64, one per kept document
    offsets: np.ndarray  # int64, len(hashes) + 1
    tokens: np.ndarray  # the shard dtype
    filtered: int
    bad: int
    text_bytes: int


@dataclass
class Scanned:
    """One unit's kept documents for the tokenizer-sample pass: hashes, sizes, and the texts whose
    hash falls under the sample's current threshold (the rest could never enter the sample)."""

    source: int
    hashes: np.ndarray
    sizes: np.ndarray
    candidates: list[tuple[int, str]]
    filtered: int
    bad: int
    text_bytes: int


def doc_hash(text: str) -> int:
    """A 64-bit content hash: exact duplicates share it (and the tokenizer sample is ordered by it)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


def refuse_unguarded_main() -> None:
    """In a worker that is starting (spawn re-runs the script that started prepare, as `__mp_main__`),
    a call of prepare means the script has no `if __name__ == "__main__":` guard: without this check
    the worker would wait on the parent's lock forever. The worker leaves the reason where the parent
    looks (`Pool`) and exits; the parent stops with it in one line."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")  # (the script, while it runs)
    script = getattr(main, "__file__", None) or "the script"
    message = (
        f"{script} calls suite's prepare at import, and every worker process (data.workers) imports it "
        'again: put the call under `if __name__ == "__main__":` (or pass data.workers=1)'
    )
    where = os.environ.get(_UNGUARDED_FILE)
    if where:
        with open(where, "w", encoding="utf-8") as f:
            f.write(message)
    else:
        print(message, file=sys.stderr)
    os._exit(2)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _init(parent: int) -> None:
    """Worker start: one thread each (the parallelism is the processes); leave when the parent dies."""
    os.environ[_PARALLELISM] = "false"
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _tokenizer(tokenizer_file: str) -> Any:
    """The tokenizer of this file, loaded once per process."""
    stat = os.stat(tokenizer_file)
    key = (tokenizer_file, stat.st_mtime_ns, stat.st_size)
    if _state.get("key") != key:
        tok = Tokenizer.from_file(tokenizer_file)
        tok.no_truncation()
        tok.no_padding()
        _state.update(key=key, tokenizer=tok)
    return _state["tokenizer"]


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def encode_unit(unit: Unit, tokenizer_file: str, eos: int, dtype: str) -> Encoded:
    """Parse, hash and tokenize one unit (runs in a worker, or in the parent with one worker); the
    tokens (an EOS after each document) in `dtype`."""
    texts, filtered, bad = unit_texts(unit)
    tok = _tokenizer(tokenizer_file)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = encode(texts, add_special_tokens=False) if texts else []
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.dtype(dtype))
    for enc, start, end in zip(encodings, offsets[:-1], offsets[1:]):
        tokens[start : end - 1] = enc.ids
        tokens[end - 1] = eos
    hashes = np.fromiter((doc_hash(t) for t in texts), dtype=np.uint64, count=len(texts))
    size = sum(len(t) for t in texts)
    return Encoded(unit.source, hashes, offsets, tokens, filtered, bad, size)


def scan_unit(unit: Unit, threshold: int) -> Scanned:
    """Parse and hash one unit for the tokenizer sample; texts are sent back only under `threshold`."""
    texts, filtered, bad = unit_texts(unit)
    hashes = np.fromiter((doc_hash(t) for t in texts), dtype=np.uint64, count=len(texts))
    sizes = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    under = np.ones(len(texts), dtype=bool) if threshold >= 2**64 else hashes < np.uint64(threshold)
    candidates = [(i, texts[i]) for i in np.flatnonzero(under).tolist()]
    return Scanned(unit.source, hashes, sizes, candidates, filtered, bad, int(sizes.sum()))


class Pool:
    """`workers` processes (or the calling process when 1) mapping units in order, a few in flight."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = None
        self._unguarded = ""
        if workers > 1:
            self._unguarded = os.path.join(
                tempfile.gettempdir(), f"suite-prepare-{os.getpid()}-{id(self)}.unguarded"
            )
            os.environ[_UNGUARDED_FILE] = self._unguarded  # the workers inherit it (refuse_unguarded_main)
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(workers, initializer=_init, initargs=(os.getpid(),))

    def map(
        self, fn: Callable[..., Any], units: Iterable[Any], extra: Callable[[], tuple] = tuple
    ) -> Iterator[Any]:
        """fn(unit, *extra()) for every unit, results in the units' order. `extra` is read at submission
        (e.g. the sample threshold as it stands then)."""
        if self._pool is None:
            saved = os.environ.get(_PARALLELISM)
            os.environ[_PARALLELISM] = "false"  # one worker means one core, as in the workers
            try:
                for unit in units:
                    yield fn(unit, *extra())
            finally:
                if saved is None:
                    os.environ.pop(_PARALLELISM, None)
                else:
                    os.environ[_PARALLELISM] = saved
            return
        pending: deque = deque()
        limit = 2 * self.workers + 1
        for unit in units:
            pending.append(self._pool.apply_async(fn, (unit, *extra())))
            if len(pending) >= limit:
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    def _result(self, pending: Any) -> Any:
        """The result, or one line when the workers cannot start (refuse_unguarded_main)."""
        while True:
            try:
                return pending.get(timeout=0.2)
            except multiprocessing.TimeoutError:
                if os.path.exists(self._unguarded):
                    with open(self._unguarded, encoding="utf-8") as f:
                        raise ConfigError(f.read()) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
            os.environ.pop(_UNGUARDED_FILE, None)
            if os.path.exists(self._unguarded):
                os.unlink(self._unguarded)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
