"""Data: the embedded corpus, tokenizer training, token shards, `suite prepare` and training batches.

`TokenBatches` loads on first use (PEP 562): a `suite prepare` worker process imports this package
for suite.data.workers and need not pay for torch through the loader."""

from __future__ import annotations

from typing import Any

from suite.data.corpus import build_embedded_corpus
from suite.data.prepare import ensure_prepared, is_prepared, prepare, read_meta
from suite.data.shards import IndexedTokens, ShardWriter
from suite.data.tokenizer import load_tokenizer, train_tokenizer

__all__ = [
    "IndexedTokens",
    "ShardWriter",
    "TokenBatches",
    "build_embedded_corpus",
    "ensure_prepared",
    "is_prepared",
    "load_tokenizer",
    "prepare",
    "read_meta",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name == "TokenBatches":
        from suite.data.loader import TokenBatches  # deferred: torch

        return TokenBatches
    raise AttributeError(f"module 'suite.data' has no attribute '{name}'")
