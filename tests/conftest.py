"""Session fixtures: a tiny prepared corpus every test can train on without network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The test files that take longest, longest first (per-file totals of a `pytest --durations=0` run on
# 2 cores, in seconds): `make test` hands files to its two workers in this order (with
# --no-loadscope-reorder), so the long ones start early and the workers finish together instead of
# one waiting on a long file handed out last. Files not listed follow in collection order.
LONGEST_FIRST = (
    "tests/e2e/test_output_folders.py",  # 344
    "tests/unit/test_plan_dryrun.py",  # 301
    "tests/e2e/test_docs_commands.py",  # 296
    "tests/distributed/test_family_layouts.py",  # ~190 (deepseek layouts run with MTP only)
    "tests/distributed/test_equivalence.py",  # 174
    "tests/e2e/test_export_gguf.py",  # 141
    "tests/e2e/test_prune.py",  # 126
    "tests/unit/test_families.py",  # ~120 measured on a loaded machine (an MoE torch.export program: 25)
    "tests/e2e/test_export_graphs.py",  # 105
    "tests/e2e/test_quantize.py",  # 87
    "tests/e2e/test_real_model.py",  # ~80 (the GGUF read into an HF folder)
    "tests/distributed/test_context_parallel.py",  # 77
    "tests/unit/test_plan_validation.py",  # 76
    "tests/distributed/test_distill.py",  # 73
    "tests/distributed/test_moe.py",  # 66
    "tests/distributed/test_muon_layouts.py",  # ~65
    "tests/e2e/test_generate_batch.py",  # 62
    "tests/e2e/test_cli.py",  # 62
    "tests/distributed/test_launcher.py",  # 61
    "tests/distributed/test_pipeline.py",  # 61
    "tests/distributed/test_real_faults.py",  # 60
    "tests/e2e/test_baseline_losses.py",  # ~60 (one test)
    "tests/e2e/test_speed.py",  # ~58
    "tests/distributed/test_finetune_parallel.py",  # 55
    "tests/e2e/test_harness.py",  # ~50
    "tests/distributed/test_align.py",  # ~50
    "tests/e2e/test_run_folders.py",  # 47
    "tests/e2e/test_grpo.py",  # ~40
    "tests/e2e/test_eval_perplexity.py",  # 40
    "tests/e2e/test_pipeline.py",  # 39
    "tests/e2e/test_export_quantized_hf.py",  # 38
    "tests/distributed/test_fault_tolerance.py",  # 37
    "tests/e2e/test_careless_inputs.py",  # 37
    "tests/distributed/test_qat.py",  # 36
    "tests/e2e/test_offload_one_process.py",  # ~35
    "tests/e2e/test_finetune.py",  # 31
    "tests/distributed/test_hierarchical_dispatch.py",  # ~30
    "tests/e2e/test_export_gguf_moe.py",  # ~25 (qwen3moe / deepseek2 in llama.cpp)
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (LONGEST_FIRST); the order inside a file is kept (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
