"""`suite finetune`, composed: chat data, a base model's weights, LoRA adapters when asked for and
a task's held-out accuracy; the loop, parallel layouts, recompute, logging, checkpoints and resume
are the trainer's (suite.train.trainer).

    data      `SFTData`: finetune.data (suite.finetune.data) rendered with the base's tokenizer and chat
              template; batches are suite.data.batch.Batch, the type pretraining uses, and the step's one
              loss weighs every target token of the global batch
    weights   `BaseWeights`: model.init_from (a suite run or checkpoint folder, or hf:<folder>;
              suite.model_source) replaces the seeded initialisation, in whatever layout the run has
    lora      `LoRA` (finetune.method=lora): adapters added on the meta model before parallelize, base
              frozen (only adapters reach the optimizer; on a MoE model per-expert adapters on the
              stacked expert weights, sharded with them under ep); each checkpoint also holds lora/
              (adapters alone), and <run.dir>/lora/ the final ones
    eval      `TaskAccuracy`: for a built-in task, greedy exact-match accuracy beside the held-out loss
    run dir   the tokenizer with the chat template it was trained with (tokenizer_config.json /
              chat_template.jinja), so eval, generate and export render prompts the same way
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.chat import use_chat_template
from suite.data.sft import SFTBatches
from suite.data.tasks import get_task
from suite.finetune.data import build_sft_data
from suite.infer.evaluate import evaluate_task
from suite.model_source import ModelSource
from suite.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    apply_lora,
    count_trainable,
    init_lora,
    lora_state_dict,
)
from suite.train.components import Component, Data, Method, Trainer

LORA_DIR = "lora"


class SFTData(Data):
    """finetune.data's chat rows, rendered with the tokenizer of `tokenizer_from` (model.init_from for
    finetuning; distillation from scratch uses the teacher's)."""

    def __init__(self, tokenizer_from: ModelSource):
        self.source = tokenizer_from

    def prepare(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.tokenizer = self.source.tokenizer()
        if len(self.tokenizer) > cfg.model.vocab_size:
            raise ConfigError(
                f"the base tokenizer has {len(self.tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}"
            )
        self.chat_template = use_chat_template(self.tokenizer, cfg.finetune.data.template)
        self.train_data, self.eval_data, self.task_eval_file = build_sft_data(
            cfg, self.tokenizer, trainer.run_dir, trainer.env.is_main
        )
        trainer.log(f"SFT train data: {self.train_data.report.summary()}")
        trainer.log(f"SFT held-out data: {self.eval_data.report.summary()}")

    def loaders(self, trainer: Trainer) -> tuple[Any, Any]:
        cfg, dims = trainer.cfg, trainer.dims
        p, dp, dp_rank = cfg.parallel, dims.data_parallel_size, trainer.placement.dp_rank
        train = SFTBatches(
            self.train_data, p.micro_batch_size, p.global_batch_size, dp_rank, dp, cfg.train.seed
        )
        eval_global = min(p.micro_batch_size * dp, len(self.eval_data))
        eval_global -= eval_global % dp
        if eval_global < dp:
            raise ConfigError(
                f"the held-out SFT data packs into {len(self.eval_data)} rows, fewer than the "
                f"{dp} data-parallel ranks; hold out more rows (finetune.data.num_eval / eval_fraction)"
            )
        held_out = SFTBatches(
            self.eval_data, min(p.micro_batch_size, eval_global // dp), eval_global, dp_rank, dp,
            cfg.train.seed, split="held-out",
        )  # fmt: skip
        if cfg.finetune.epochs is not None:
            steps = max(1, math.ceil(cfg.finetune.epochs * train.steps_per_epoch))
            trainer.log(
                f"finetune.epochs={cfg.finetune.epochs}: {steps} steps ({train.steps_per_epoch} per epoch)"
            )
            cfg.train.max_steps = steps
        return train, held_out

    def write_run_files(self, trainer: Trainer) -> None:
        # tokenizer.json, tokenizer_config.json and chat_template.jinja: the template trained with
        self.tokenizer.save_pretrained(trainer.run_dir)

    def vocab(self) -> dict:
        return self.tokenizer.get_vocab()


class BaseWeights(Component):
    """The base model's weights (a ModelSource), resharded into this run's layout."""

    def __init__(self, source: ModelSource):
        self.source = source

    def load_weights(self, trainer: Trainer) -> None:
        self.source.load_weights(trainer.model, trainer.cfg.model.fused_projections)


class LoRA(Component):
    """finetune.method=lora: adapters on the meta model, initialised after the base weights are in
    place (compose it after BaseWeights), written into every checkpoint and at the end."""

    def adapt_model(self, trainer: Trainer, model: torch.nn.Module) -> None:
        lo = trainer.cfg.finetune.lora
        apply_lora(model, lo.rank, lo.alpha, lo.dropout, tuple(lo.target_modules), trainer.cfg.train.seed)

    def load_weights(self, trainer: Trainer) -> None:
        init_lora(trainer.model, trainer.cfg.train.seed)
        counts = count_trainable(trainer.model)
        shard = "; this rank's shard" if trainer.dims.world_size > 1 else ""
        trainer.log(
            f"LoRA rank {trainer.cfg.finetune.lora.rank}: {counts.trainable:,} of {counts.total:,} "
            f"parameters trainable ({counts.ratio:.2%}{shard})"
        )

    def checkpoint_extra(self, trainer: Trainer) -> Callable[[Path], None]:
        state = lora_state_dict(trainer.model)  # collective for sharded adapters: every rank gathers
        return lambda folder: self._write(trainer.cfg, state, folder / LORA_DIR)

    def finish(self, trainer: Trainer, summary: dict) -> None:
        write = self.checkpoint_extra(trainer)
        if trainer.env.is_main:
            write(trainer.run_dir)
            print(f"wrote LoRA adapters to {trainer.run_dir / LORA_DIR}/", flush=True)

    @staticmethod
    def _write(cfg: SuiteConfig, state: dict[str, torch.Tensor], out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_FILE))
        lo = cfg.finetune.lora
        spec = {**asdict(lo), "target_modules": list(lo.target_modules), "base": cfg.model.init_from}
        (out / ADAPTER_CONFIG).write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")


class TaskAccuracy(Component):
    """A built-in task's greedy exact-match accuracy on its held-out file at every evaluation
    (finetune.eval_samples > 0); skipped under tp, pp and cp, where `suite eval` runs it afterwards."""

    def __init__(self, data: SFTData):
        self.data = data

    def eval_metrics(self, trainer: Trainer) -> dict:
        ft, dims, data = trainer.cfg.finetune, trainer.dims, self.data
        if data.task_eval_file is None or ft.eval_samples <= 0:
            return {}
        if dims.tp > 1 or dims.pp > 1 or dims.cp > 1:
            return {}  # greedy decoding runs on whole layers and sequences; `suite eval` afterwards
        # under ep the experts sit outside the data-parallel mixed-precision policy: bf16
        # activations meet fp32 expert weights, which autocast reconciles as in training
        context = trainer.autocast if dims.ep > 1 else contextlib.nullcontext
        with context():
            result = evaluate_task(
                trainer.model,
                data.tokenizer,
                ft.data.task,
                data.task_eval_file,
                max_new_tokens=ft.max_new_tokens or get_task(ft.data.task).max_answer_chars + 2,
                limit=ft.eval_samples,
                template=data.chat_template,
            )
        return {"val_accuracy": result["accuracy"]}


def base_source(cfg: SuiteConfig) -> ModelSource:
    """model.init_from, which finetuning starts from (and takes its tokenizer from)."""
    if not cfg.model.init_from:
        raise ConfigError(
            "model.init_from is missing; finetuning starts from a base model: model.init_from=runs/gpt-tiny "
            "(a suite run) or model.init_from=hf:<folder>"
        )
    return ModelSource.parse(cfg.model.init_from, "model.init_from")


def compose(cfg: SuiteConfig) -> Method:
    """`suite finetune`: chat data from the base's tokenizer, its weights, LoRA when asked, task accuracy."""
    source = base_source(cfg)
    data = SFTData(source)
    lora = [LoRA()] if cfg.finetune.method == "lora" else []
    return Method("finetune", data, [BaseWeights(source), *lora, TaskAccuracy(data)])
