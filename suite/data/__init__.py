"""Data: the embedded corpus, tokenizer training, token shards, `suite prepare` and training batches."""

from suite.data.corpus import build_embedded_corpus
from suite.data.loader import TokenBatches
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
