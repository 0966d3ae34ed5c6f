"""`suite distill`: the pretraining Trainer with a frozen teacher inside its step.

The student is the recipe's model (from scratch, or model.init_from: e.g. a pruned teacher); the
data is the recipe's pretraining data, whose tokenizer must be the teacher's. Only the step differs
(suite.distill.step.DistillStep); the loop, layouts, logging, checkpoints and resume are the Trainer's.
"""

from __future__ import annotations

from suite.config.errors import ConfigError
from suite.distill.step import DistillStep
from suite.distill.teacher import load_teacher
from suite.train.step import training_loss
from suite.train.trainer import Trainer


class DistillTrainer(Trainer):
    verb = "distill"

    def _make_step(self, **options):
        teacher = load_teacher(self.cfg, self.dims, self.device, self.precision)
        self._check_tokenizer(teacher)
        self._log(
            f"teacher: {teacher.source.text} ({sum(p.numel() for p in teacher.model.parameters()):,} parameters on this rank)"
        )
        return DistillStep(
            self.placement,
            self.optimizer,
            training_loss(self.model, False),  # dense students only (suite.distill.checks)
            self.autocast,
            self.scaler,
            teacher=teacher,
            distill=self.cfg.distill,
            **options,
        )

    def _check_tokenizer(self, teacher) -> None:
        """The teacher must read the student's data as the student does: the same vocabulary."""
        from suite.data import load_tokenizer

        mine = load_tokenizer(self.data_dir).get_vocab()
        theirs = teacher.source.tokenizer().get_vocab()
        if mine != theirs:
            raise ConfigError(
                f"distill.teacher='{teacher.source.text}' has another tokenizer than the student's data "
                f"({len(theirs):,} vs {len(mine):,} tokens, or other ids); prepare the data with the teacher's "
                "tokenizer (data.tokenizer=<teacher run>/tokenizer.json) or pick a teacher trained on it"
            )
