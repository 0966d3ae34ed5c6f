"""Session fixtures: a tiny prepared corpus every test can train on without network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A module is a file containing Python definitions and statements.",
    "Tensors are multi-dimensional arrays with a uniform type.",
    "The optimizer updates the parameters using the computed gradients.",
    "In 1984 there were 365 days and 12 months in the calendar year.",
    "Each process in the group holds a shard of the model weights.",
    "Attention lets every token look at the tokens that came before it.",
    "The checkpoint is written to a temporary folder and then renamed.",
]


def write_tiny_corpus(folder: Path, num_docs: int = 400) -> Path:
    """A deterministic corpus (JSON lines, one document each) of short documents."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    lines = []
    for i in range(num_docs):
        doc = " ".join(SENTENCES[(i * 7 + j) % len(SENTENCES)] for j in range(6 + i % 5))
        lines.append(json.dumps({"text": f"Document {i}: {doc}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared data folder (tokenizer + train/val shards) with a 512-token vocabulary."""
    from suite.config.schema import DataConfig, DataSourceConfig
    from suite.data import prepare

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_tiny_corpus(root / "text")
    cfg = DataConfig(sources=[DataSourceConfig(path=str(corpus))], vocab_size=512, val_fraction=0.05)
    return prepare(cfg, root / "prepared", progress=False)
