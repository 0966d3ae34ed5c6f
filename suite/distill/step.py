"""The distillation step: the training step whose loss also runs the frozen teacher.

Everything else (micro-batches, the token weighting over the global batch, data-parallel
synchronisation, clipping, the optimizer skip) is TrainStep's. Evaluation (model in eval mode)
keeps TrainStep's plain cross-entropy, so the held-out loss compares with the teacher's own.
With distill.hidden_weight > 0 the loss adds hidden-state matching (suite.distill.hidden).
"""

from __future__ import annotations

import torch

from suite.config.schema import DistillConfig
from suite.distill.hidden import PROJECTIONS, BlockOutputs, hidden_loss, layer_pairs
from suite.distill.loss import distill_loss
from suite.distill.teacher import Teacher
from suite.train.step import TrainStep


class DistillStep(TrainStep):
    def __init__(self, *args, teacher: Teacher, distill: DistillConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.distill = distill
        self.pairs = (
            layer_pairs(len(self.model.layers), len(teacher.model.layers)) if distill.hidden_weight else []
        )
        self.projections = getattr(self.model, PROJECTIONS, None)  # None: the widths are equal
        self.hidden_weight = (
            distill.hidden_weight
        )  # this step's (distill.hidden_schedule); the trainer sets it

    def model_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, kwargs: dict, weight, aux_weight: float = 0.0
    ) -> torch.Tensor:
        if not self.model.training:
            return super().model_loss(tokens, targets, kwargs, weight, aux_weight)
        d, pairs = self.distill, self.pairs
        teacher_hidden, teacher_blocks = self.teacher.hidden(tokens, kwargs, [t for _, t in pairs])

        with BlockOutputs(self.model, [s for s, _ in pairs]) as student_blocks:

            def head(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
                loss = distill_loss(
                    hidden,
                    head_weight,
                    teacher_hidden,
                    self.teacher.head_weight,
                    targets,
                    kind=d.loss,
                    temperature=d.temperature,
                    ce_weight=d.ce_weight,
                    chunk_tokens=d.chunk_tokens,
                )
                if pairs:  # inside the forward: FSDP has the projections (root parameters) whole
                    matched = hidden_loss(
                        student_blocks.outputs,
                        teacher_blocks,
                        pairs,
                        self.projections,
                        targets,
                        d.hidden_loss,
                    )
                    loss = loss + self.hidden_weight * matched
                return loss * weight

            return self.model(tokens, head=head, **kwargs)
