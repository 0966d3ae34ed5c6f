"""`suite distill`: a training verb's trainer with a frozen teacher inside its step.

The student is the recipe's model (from scratch, or model.init_from: e.g. a pruned teacher). The data
is the recipe's pretraining data (`distill.data=pretrain`, the pretraining Trainer) or chat rows
(`distill.data=sft`: finetune.data's task or sources, the finetuning Trainer, with the held-out task
accuracy of the student at every evaluation); either way its tokenizer must be the teacher's. Only the
step differs (suite.distill.step.DistillStep); loop, layouts, logging, checkpoints and resume are the
Trainer's.
"""

from __future__ import annotations

from suite.config.errors import ConfigError
from suite.distill.hidden import attach_projections, hidden_weight_at
from suite.distill.step import DistillStep
from suite.distill.teacher import Teacher, load_teacher
from suite.finetune.trainer import FinetuneTrainer
from suite.model_source import ModelSource
from suite.train.step import training_loss
from suite.train.trainer import Trainer


class _WithTeacher:
    """The step with the teacher in it; `_student_vocab` is the student data's tokenizer vocabulary."""

    verb = "distill"

    def _adapt_model(self, model) -> None:
        """Hidden-state matching between models of different widths: the learned projections."""
        super()._adapt_model(model)
        if self.cfg.distill.hidden_weight:
            teacher = ModelSource.parse(self.cfg.distill.teacher, "distill.teacher").model_config()
            attach_projections(model, self.cfg.model.hidden_size, teacher.hidden_size)

    def train_step(self, micro_batches):
        """The training step at this step's hidden-state weight (distill.hidden_schedule)."""
        d = self.cfg.distill
        self.runner.hidden_weight = hidden_weight_at(
            d.hidden_weight, d.hidden_schedule, self.step, self.cfg.train.max_steps
        )
        return super().train_step(micro_batches)

    def _make_step(self, **options):
        teacher = load_teacher(self.cfg, self.dims, self.device, self.precision)
        mine, theirs = self._student_vocab(), teacher.source.tokenizer().get_vocab()
        if mine != theirs:
            raise ConfigError(
                f"distill.teacher='{teacher.source.text}' has another tokenizer than the student's data "
                f"({len(theirs):,} vs {len(mine):,} tokens, or other ids); prepare the data with the teacher's "
                "tokenizer (data.tokenizer=<teacher run>/tokenizer.json) or pick a teacher trained on it"
            )
        self._log(f"teacher: {teacher.source.text} ({_count(teacher):,} parameters on this rank)")
        return DistillStep(
            self.placement,
            self.optimizer,
            training_loss(self.model, bool(self.cfg.model.num_experts)),  # evaluation's loss
            self.autocast,
            self.scaler,
            teacher=teacher,
            distill=self.cfg.distill,
            moe=bool(self.cfg.model.num_experts),
            sp=self.cfg.parallel.sp,
            **options,
        )


def _count(teacher: Teacher) -> int:
    return sum(p.numel() for p in teacher.model.parameters())


class DistillTrainer(_WithTeacher, Trainer):
    """distill.data=pretrain: the recipe's prepared token shards."""

    def _student_vocab(self) -> dict:
        from suite.data import load_tokenizer

        return load_tokenizer(self.data_dir).get_vocab()


class SFTDistillTrainer(_WithTeacher, FinetuneTrainer):
    """distill.data=sft: finetune.data's chat rows, rendered with the tokenizer of the student's base
    (model.init_from) or, for a student from scratch, the teacher's."""

    def _tokenizer_source(self) -> ModelSource:
        if self.cfg.model.init_from:
            return super()._tokenizer_source()
        return ModelSource.parse(self.cfg.distill.teacher, "distill.teacher")

    def _load_initial_weights(self) -> None:
        if self.cfg.model.init_from:  # else the seeded initialisation: a student from scratch
            super()._load_initial_weights()

    def _student_vocab(self) -> dict:
        return self.tokenizer.get_vocab()
