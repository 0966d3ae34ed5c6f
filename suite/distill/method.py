"""`suite distill`, composed: the student's data and weights as pretraining or finetuning has them,
plus `Distillation`, the component that holds the frozen teacher and supplies the step's loss.

The student is the recipe's model (from scratch, or model.init_from: e.g. a pruned teacher). The data
is the recipe's pretraining data (`distill.data=pretrain`) or chat rows (`distill.data=sft`:
finetune.data's task or sources, with the student's held-out task accuracy at every evaluation);
either way its tokenizer must be the teacher's. The step is the common one (any layout the checks
allow, pipeline parallelism included) with `suite.distill.step_loss.DistillLoss` as its training loss.
"""

from __future__ import annotations

import torch

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.distill.hidden import attach_projections, hidden_weight_at
from suite.distill.step_loss import DistillLoss
from suite.distill.teacher import Teacher, load_teacher
from suite.finetune.method import BaseWeights, SFTData, TaskAccuracy
from suite.model_source import ModelSource, initial_weights
from suite.pretrain.method import InitialWeights, TokenData
from suite.train.components import Component, Method, Trainer


class Distillation(Component):
    """The frozen teacher (loaded when the step is built, placed like the student) and its loss."""

    def __init__(self):
        self.loss: DistillLoss | None = None

    def adapt_model(self, trainer: Trainer, model: torch.nn.Module) -> None:
        """Hidden-state matching between models of different widths: the learned projections."""
        cfg = trainer.cfg
        if cfg.distill.hidden_weight:
            teacher = ModelSource.parse(cfg.distill.teacher, "distill.teacher").model_config()
            attach_projections(model, cfg.model.hidden_size, teacher.hidden_size)

    def step_loss(self, trainer: Trainer) -> DistillLoss:
        cfg = trainer.cfg
        teacher = load_teacher(cfg, trainer.dims, trainer.device, trainer.precision)
        mine, theirs = trainer.data.vocab(), teacher.source.tokenizer().get_vocab()
        if mine != theirs:
            raise ConfigError(
                f"distill.teacher='{teacher.source.text}' has another tokenizer than the student's data "
                f"({len(theirs):,} vs {len(mine):,} tokens, or other ids); prepare the data with the teacher's "
                "tokenizer (data.tokenizer=<teacher run>/tokenizer.json) or pick a teacher trained on it"
            )
        trainer.log(f"teacher: {teacher.source.text} ({_count(teacher):,} parameters on this rank)")
        moe = bool(cfg.model.num_experts)
        self.loss = DistillLoss(trainer.placement, teacher, cfg.distill, moe, cfg.parallel.sp)
        pipeline = trainer.placement.pipeline
        if pipeline is not None and not pipeline.has_last:  # the loss runs on the last stage only
            teacher.release()
        return self.loss

    def before_step(self, trainer: Trainer) -> None:
        """The step's hidden-state weight (distill.hidden_schedule)."""
        d = trainer.cfg.distill
        self.loss.hidden_weight = hidden_weight_at(
            d.hidden_weight, d.hidden_schedule, trainer.step, trainer.cfg.train.max_steps
        )


def _count(teacher: Teacher) -> int:
    return sum(p.numel() for p in teacher.model.parameters())


def compose(cfg: SuiteConfig) -> Method:
    """distill.data=pretrain: the prepared token shards (as `suite pretrain`); distill.data=sft: chat rows
    rendered with the tokenizer of the student's base (model.init_from) or, from scratch, the teacher's."""
    if cfg.distill.data != "sft":
        return Method("distill", TokenData(), [InitialWeights(initial_weights(cfg)), Distillation()])
    if cfg.model.init_from:
        base = ModelSource.parse(cfg.model.init_from, "model.init_from")
        data = SFTData(base)
        weights: list[Component] = [BaseWeights(base)]
    else:  # a student from scratch: the seeded initialisation
        data = SFTData(ModelSource.parse(cfg.distill.teacher, "distill.teacher"))
        weights = []
    return Method("distill", data, [*weights, Distillation(), TaskAccuracy(data)])
