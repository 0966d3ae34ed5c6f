"""The distillation step: the training step whose loss also runs the frozen teacher.

Everything else (micro-batches, the token weighting over the global batch, data-parallel
synchronisation, clipping, the optimizer skip) is TrainStep's. Evaluation (model in eval mode)
keeps TrainStep's plain cross-entropy, so the held-out loss compares with the teacher's own.
With distill.hidden_weight > 0 the loss adds hidden-state matching (suite.distill.hidden); an MoE
student's router losses (balance, z) are added as in pretraining.

Under tensor parallelism (with or without sp) both models' heads are vocabulary-sharded: the loss
runs on this rank's vocabulary rows with the reductions of suite.distill.vocab_parallel, on the whole
sequence (gathered under sp), as are the matched block outputs; every tp rank then holds the same loss.
"""

from __future__ import annotations

import torch

from suite.config.schema import DistillConfig
from suite.distill.hidden import PROJECTIONS, BlockOutputs, hidden_loss, layer_pairs
from suite.distill.loss import distill_loss
from suite.distill.teacher import Teacher
from suite.distill.vocab_parallel import VocabShard
from suite.models.moe import moe_aux_loss
from suite.train.step import TrainStep


class DistillStep(TrainStep):
    def __init__(
        self, *args, teacher: Teacher, distill: DistillConfig, moe: bool = False, sp: bool = False, **kwargs
    ):
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
        self.moe = moe  # the student's router losses join the loss
        self.shard, self.whole = None, lambda x: x
        dims = self.placement.dims
        if dims.tp > 1:  # vocabulary-sharded heads, whole sequences for the loss
            from suite.parallel.tensor_parallel import whole_sequence

            tp_mesh = self.placement.mesh["tp"]
            self.shard = VocabShard(*teacher.vocab_rows, tp_mesh.get_group())
            self.whole = lambda x: whole_sequence(x, tp_mesh, sp)

    def model_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, kwargs: dict, weight, aux_weight: float = 0.0
    ) -> torch.Tensor:
        if not self.model.training:
            return super().model_loss(tokens, targets, kwargs, weight, aux_weight)
        d, pairs, whole = self.distill, self.pairs, self.whole
        teacher_hidden, teacher_blocks = self.teacher.hidden(tokens, kwargs, [t for _, t in pairs])

        with BlockOutputs(self.model, [s for s, _ in pairs]) as student_blocks:

            def head(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
                if self.shard is not None:  # this rank's vocabulary rows of the head
                    head_weight = head_weight.to_local()
                    if head_weight.shape[0] != self.teacher.head_weight.shape[0]:
                        raise RuntimeError(
                            f"student head rows {head_weight.shape[0]} != teacher's {self.teacher.vocab_rows}"
                        )
                loss = distill_loss(
                    whole(hidden),
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
                if pairs:  # inside the forward: FSDP has the projections (root parameters) whole
                    matched = hidden_loss(
                        {i: whole(x) for i, x in student_blocks.outputs.items()},
                        {i: whole(x) for i, x in teacher_blocks.items()},
                        pairs,
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

            return self.model(tokens, head=head, **kwargs)
