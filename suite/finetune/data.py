"""Chat data for finetuning (and distillation on chat rows): finetune.data's built-in task (generated
into <run.dir>/task/) or rows from local files / `datasets`, rendered with the chat template, loss
masked to assistant tokens, packed into suite.data.batch.Batch rows (suite.data.sft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.sft import SFTDataset, SFTOptions, iter_sft_rows
from suite.data.tasks import write_task
from suite.parallel.env import barrier

TASK_DIR = "task"


def sft_options(cfg: SuiteConfig, template: str) -> SFTOptions:
    d = cfg.finetune.data
    return SFTOptions(
        seq_len=cfg.data.seq_len,
        template=template,
        packing=d.packing,
        truncation=d.truncation,
        on_error=d.on_error,
        system_prompt=d.system_prompt,
        shuffle_seed=cfg.train.seed,
        key="finetune.data",
    )


def _split_rows(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) rows: a seeded `fraction` of the rows (at least one) held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    count = max(1, int(round(fraction * len(rows)))) if fraction > 0 else 0
    held = set(order[:count].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def build_sft_data(
    cfg: SuiteConfig, tokenizer: Any, run_dir: Path, is_main: bool
) -> tuple[SFTDataset, SFTDataset, Path | None]:
    """(train dataset, held-out dataset, held-out task file or None) from cfg.finetune.data."""
    d = cfg.finetune.data
    opts = sft_options(cfg, tokenizer.chat_template)
    if d.task:
        if is_main:
            write_task(d.task, run_dir / TASK_DIR, d.num_train, d.num_eval, seed=d.task_seed)
        barrier()
        folder = run_dir / TASK_DIR
        return (
            SFTDataset.build(str(folder / "train.jsonl"), tokenizer, opts),
            SFTDataset.build(str(folder / "eval.jsonl"), tokenizer, opts),
            folder / "eval.jsonl",
        )
    if not d.sources:
        raise ConfigError(
            "finetune.data has neither a task nor sources; set finetune.data.task=reverse-6 or "
            "'finetune.data.sources=[{path: data/train.jsonl}]'"
        )
    if d.eval_sources:
        return (
            SFTDataset.build(list(d.sources), tokenizer, opts),
            SFTDataset.build(list(d.eval_sources), tokenizer, opts),
            None,
        )
    if not 0.0 < d.eval_fraction < 1.0:
        raise ConfigError(
            f"finetune.data.eval_fraction={d.eval_fraction} must be in (0, 1) when finetune.data.eval_sources "
            "is empty; e.g. 0.02"
        )
    train_rows, held_rows = _split_rows(list(iter_sft_rows(list(d.sources))), d.eval_fraction, cfg.train.seed)
    return (
        SFTDataset.from_rows(train_rows, tokenizer, opts),
        SFTDataset.from_rows(held_rows, tokenizer, opts),
        None,
    )
