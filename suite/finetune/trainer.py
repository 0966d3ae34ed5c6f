"""`suite finetune`: the pretraining Trainer, fed chat data and started from a base checkpoint.

Only what differs from pretraining lives here (the loop, parallel layouts, recompute, logging,
checkpoints and resume are the Trainer's):

    data      finetune.data: a built-in task (generated into <run.dir>/task/) or chat rows from local
              files / `datasets`, rendered with the chat template, loss masked to assistant tokens,
              packed; batches are suite.data.batch.Batch (tokens, labels, positions, doc_ids), the
              type pretraining uses, and the step's one loss weighs every target token of the global batch
    weights   model.init_from (a suite run or checkpoint folder, or hf:<folder>; suite.model_source) replaces
              the seeded initialisation, in whatever layout the run has
    lora      finetune.method=lora: adapters added on the meta model before parallelize, base
              frozen (only adapters reach the optimizer; on a MoE model per-expert adapters on the
              stacked expert weights, sharded with them under ep); each checkpoint also holds lora/
              (adapters alone), and <run.dir>/lora/ the final ones
    eval      held-out loss at train.eval_every and, for a task, greedy exact-match accuracy
    run dir   the tokenizer with the chat template it was trained with (tokenizer_config.json /
              chat_template.jinja), so eval, generate and export render prompts the same way
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.chat import use_chat_template
from suite.data.sft import SFTBatches, SFTDataset, SFTOptions, iter_sft_rows
from suite.model_source import ModelSource
from suite.parallel.env import barrier
from suite.train.trainer import Trainer

TASK_DIR = "task"
LORA_DIR = "lora"


# ---- data ----------------------------------------------------------------------------------------
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
        from suite.data.tasks import write_task

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


# ---- the trainer -----------------------------------------------------------------------------------
class FinetuneTrainer(Trainer):
    verb = "finetune"

    def _tokenizer_source(self) -> ModelSource:
        """Where the tokenizer (and the chat template) comes from: the base model."""
        if not self.cfg.model.init_from:
            raise ConfigError(
                "model.init_from is missing; finetuning starts from a base model: model.init_from=runs/gpt-tiny "
                "(a suite run) or model.init_from=hf:<folder>"
            )
        return ModelSource.parse(self.cfg.model.init_from, "model.init_from")

    def _setup_data(self) -> None:
        cfg = self.cfg
        self.source = self._tokenizer_source()
        self.tokenizer = self.source.tokenizer()
        if len(self.tokenizer) > cfg.model.vocab_size:
            raise ConfigError(
                f"the base tokenizer has {len(self.tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}"
            )
        self.chat_template = use_chat_template(self.tokenizer, cfg.finetune.data.template)
        self.train_data, self.eval_data, self.task_eval_file = build_sft_data(
            cfg, self.tokenizer, self.run_dir, self.env.is_main
        )
        self._log(f"SFT train data: {self.train_data.report.summary()}")
        self._log(f"SFT held-out data: {self.eval_data.report.summary()}")

    def _adapt_model(self, model: nn.Module) -> None:
        super()._adapt_model(model)  # compress=qat-*: fake-quantized Linear layers
        ft = self.cfg.finetune
        if ft.method == "lora":
            from suite.models.lora import apply_lora

            lo = ft.lora
            apply_lora(model, lo.rank, lo.alpha, lo.dropout, tuple(lo.target_modules), self.cfg.train.seed)

    def _load_initial_weights(self) -> None:
        self.source.load_weights(self.model, self.cfg.model.fused_projections)
        if self.cfg.finetune.method == "lora":
            from suite.models.lora import count_trainable, init_lora

            init_lora(self.model, self.cfg.train.seed)
            counts = count_trainable(self.model)
            self.trainable = counts
            self._log(
                f"LoRA rank {self.cfg.finetune.lora.rank}: {counts.trainable:,} of {counts.total:,} parameters "
                f"trainable ({counts.ratio:.2%}; this rank's shard)"
                if self.dims.world_size > 1
                else f"LoRA rank {self.cfg.finetune.lora.rank}: {counts.trainable:,} of {counts.total:,} "
                f"parameters trainable ({counts.ratio:.2%})"
            )

    def _build_loaders(self) -> None:
        cfg, dims = self.cfg, self.dims
        p = cfg.parallel
        self.loader = SFTBatches(
            self.train_data,
            p.micro_batch_size,
            p.global_batch_size,
            self.placement.dp_rank,
            dims.data_parallel_size,
            cfg.train.seed,
        )
        eval_global = min(p.micro_batch_size * dims.data_parallel_size, len(self.eval_data))
        eval_global -= eval_global % dims.data_parallel_size
        if eval_global < dims.data_parallel_size:
            raise ConfigError(
                f"the held-out SFT data packs into {len(self.eval_data)} rows, fewer than the "
                f"{dims.data_parallel_size} data-parallel ranks; hold out more rows (finetune.data.num_eval / "
                "eval_fraction)"
            )
        self.val_loader = SFTBatches(
            self.eval_data,
            min(p.micro_batch_size, eval_global // dims.data_parallel_size),
            eval_global,
            self.placement.dp_rank,
            dims.data_parallel_size,
            cfg.train.seed,
            split="held-out",
        )
        if cfg.finetune.epochs is not None:
            steps = max(1, math.ceil(cfg.finetune.epochs * self.loader.steps_per_epoch))
            self._log(
                f"finetune.epochs={cfg.finetune.epochs}: {steps} steps ({self.loader.steps_per_epoch} per epoch)"
            )
            cfg.train.max_steps = steps

    def _write_run_files(self) -> None:
        # tokenizer.json, tokenizer_config.json and chat_template.jinja: the template trained with
        self.tokenizer.save_pretrained(self.run_dir)

    def _checkpoint_extra(self):
        if self.cfg.finetune.method != "lora":
            return None
        from suite.models.lora import lora_state_dict

        state = lora_state_dict(self.model)  # collective for sharded adapters: every rank gathers
        return lambda folder: self._write_adapters(state, folder / LORA_DIR)

    def _write_adapters(self, state: dict[str, torch.Tensor], out: Path) -> None:
        import json
        from dataclasses import asdict

        from safetensors.torch import save_file

        from suite.models.lora import ADAPTER_CONFIG, ADAPTER_FILE

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_FILE))
        lo = self.cfg.finetune.lora
        spec = {**asdict(lo), "target_modules": list(lo.target_modules), "base": self.cfg.model.init_from}
        (out / ADAPTER_CONFIG).write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")

    def eval_metrics(self) -> dict:
        metrics = {"val_loss": self.evaluate()}
        ft = self.cfg.finetune
        if self.task_eval_file is not None and ft.eval_samples > 0:
            if self.dims.tp > 1 or self.dims.pp > 1 or self.dims.cp > 1:
                return metrics  # greedy decoding runs on whole layers and sequences; `suite eval` afterwards
            from suite.data.tasks import get_task
            from suite.infer.evaluate import evaluate_task

            # under ep the experts sit outside the data-parallel mixed-precision policy: bf16
            # activations meet fp32 expert weights, which autocast reconciles as in training
            context = self.autocast if self.dims.ep > 1 else contextlib.nullcontext
            with context():
                result = evaluate_task(
                    self.model,
                    self.tokenizer,
                    ft.data.task,
                    self.task_eval_file,
                    max_new_tokens=ft.max_new_tokens or get_task(ft.data.task).max_answer_chars + 2,
                    limit=ft.eval_samples,
                    template=self.chat_template,
                )
            metrics["val_accuracy"] = result["accuracy"]
        return metrics

    def train(self) -> dict:
        summary = super().train()
        if self.cfg.finetune.method == "lora":
            extra = self._checkpoint_extra()
            if self.env.is_main:
                extra(self.run_dir)
                print(f"wrote LoRA adapters to {self.run_dir / LORA_DIR}/", flush=True)
        return summary
