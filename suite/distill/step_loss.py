"""The distillation loss inside the common training step: a `suite.train.step.MethodLoss`.

The step is the one every method runs (suite.train.step_builder.build_step: micro-batches, the token
weighting over the global batch, data-parallel synchronisation, clipping, the optimizer skip, the
pipeline schedule); distillation only supplies the loss of a training micro-batch: the frozen teacher
runs on the micro-batch's tokens, then its final hidden states meet the student's. Evaluation (model
in eval mode) keeps the step's plain cross-entropy, so the held-out loss compares with the teacher's
own. With distill.hidden_weight > 0 the loss adds hidden-state matching (suite.distill.hidden); an MoE
student's router losses (balance, z) are added as in pretraining.

- Accumulation step: the loss gets the student's final hidden states and head weight (`HeadInput`)
  and projects both models chunk by chunk (suite.distill.divergence), so no full-vocabulary distribution of
  a whole micro-batch exists. Under tensor parallelism (with or without sp) both heads are
  vocabulary-sharded: the loss runs on this rank's rows with the reductions of
  suite.distill.vocab_parallel, on the whole sequence (gathered under sp).
- Pipeline schedule (pp > 1): the loss runs on the last stage, which gets the stage's logits and the
  micro-batch's targets; the step hands it that micro-batch's tokens, so the teacher (held whole by
  the last stage's ranks) runs there and its logits meet the student's, as one process computes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import DistillConfig
from suite.distill.divergence import distill_loss, token_losses
from suite.distill.hidden import PROJECTIONS, BlockOutputs, hidden_loss, layer_pairs
from suite.distill.teacher import Teacher
from suite.distill.vocab_parallel import VocabShard
from suite.models.moe import moe_aux_loss
from suite.parallel.parallelize import Placement
from suite.parallel.tensor_parallel import whole_sequence
from suite.train.loss import HeadInput
from suite.train.step import LossFn


class DistillLoss:
    """The student's training loss against the frozen teacher on the same micro-batch."""

    def __init__(self, placement: Placement, teacher: Teacher, distill: DistillConfig, moe: bool, sp: bool):
        self.model: nn.Module = placement.model
        self.teacher = teacher
        self.distill = distill
        self.pairs = (
            layer_pairs(len(self.model.layers), len(teacher.model.layers)) if distill.hidden_weight else []
        )
        self.projections = getattr(self.model, PROJECTIONS, None)  # None: the widths are equal
        self.hidden_weight = distill.hidden_weight  # this step's (distill.hidden_schedule); set per step
        self.moe = moe  # the student's router losses join the loss (the pipeline schedule adds its own)
        self.shard: VocabShard | None = None
        self.whole = lambda x: x
        if placement.dims.tp > 1:  # vocabulary-sharded heads, whole sequences for the loss
            tp_mesh = placement.mesh["tp"]
            self.shard = VocabShard(*teacher.vocab_rows, tp_mesh.get_group())
            self.whole = lambda x: whole_sequence(x, tp_mesh, sp)

    @contextmanager
    def micro_batch(self, tokens: torch.Tensor, kwargs: dict) -> Iterator[LossFn]:
        """The teacher's outputs for these tokens; the student's matched block outputs while inside."""
        teacher_hidden, teacher_blocks = self.teacher.hidden(tokens, kwargs, [t for _, t in self.pairs])
        with BlockOutputs(self.model, [s for s, _ in self.pairs]) as student_blocks:
            yield partial(self._loss, teacher_hidden, teacher_blocks, student_blocks.outputs)

    def _loss(
        self,
        teacher_hidden,
        teacher_blocks: dict,
        student_blocks: dict,
        output,
        targets,
        weight,
        aux_weight=0.0,
    ) -> torch.Tensor:
        if not isinstance(output, HeadInput):  # the pipeline's last stage: the student's logits
            return self._logits_loss(output, teacher_hidden, targets) * weight
        d, whole, head_weight = self.distill, self.whole, output.weight
        if self.shard is not None:  # this rank's vocabulary rows of the head
            head_weight = head_weight.to_local()
            if head_weight.shape[0] != self.teacher.head_weight.shape[0]:
                raise RuntimeError(
                    f"student head rows {head_weight.shape[0]} != teacher's {self.teacher.vocab_rows}"
                )
        loss = distill_loss(
            whole(output.hidden),
            head_weight,
            whole(teacher_hidden),
            self.teacher.head_weight,
            targets,
            kind=d.loss,
            temperature=d.temperature,
            ce_weight=d.ce_weight,
            chunk_tokens=d.chunk_tokens,
            shard=self.shard,
        )
        if self.pairs:  # inside the forward: FSDP has the projections (root parameters) whole
            matched = hidden_loss(
                {i: whole(x) for i, x in student_blocks.items()},
                {i: whole(x) for i, x in teacher_blocks.items()},
                self.pairs,
                self.projections,
                targets,
                d.hidden_loss,
            )
            loss = loss + self.hidden_weight * matched
        loss = loss * weight
        if self.moe and aux_weight:  # as suite.train.step.training_loss: per micro-batch means
            aux = moe_aux_loss(self.model)
            if aux is not None:
                loss = loss + aux.to(loss.device) * aux_weight
        return loss

    def _logits_loss(self, logits: torch.Tensor, teacher_hidden: torch.Tensor, targets: torch.Tensor):
        """Summed loss of whole logits [b, s, vocab] (a pipeline's last stage: no tp, no hidden pairs)."""
        d = self.distill
        teacher_logits = F.linear(teacher_hidden.detach(), self.teacher.head_weight)
        return token_losses(
            logits.flatten(0, -2).float(),
            teacher_logits.flatten(0, -2).float(),
            targets.flatten(),
            d.loss,
            d.temperature,
            d.ce_weight,
        ).sum()
