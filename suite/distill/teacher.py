"""The frozen teacher: built, placed and loaded like the student, then only ever run forward.

The teacher (suite.frozen_model.load_frozen) is parallelised by the same `parallelize` as the student (same mesh and data-parallel
kind: sharded under FSDP, so no rank holds a whole teacher it would not hold a whole student of),
loaded from its source (suite.model_source.ModelSource: a suite run/checkpoint or hf:<folder>, resharded
to this layout), set to eval mode with every parameter frozen. It hands the step its final hidden
states (the forward's `head` hook returns them instead of logits) and its output head weight, gathered
once into a plain tensor (under tp only this rank's vocabulary rows of it, the rows its student head
holds): the distillation loss projects both models chunk by chunk itself. With hidden-state matching
it also hands over the outputs of the blocks the student's are matched to.

Under pipeline parallelism the student's loss runs on its last stage only, so the teacher is not
split into stages: every rank builds it whole and loads it (the load is collective), and the ranks
without the last stage let it go (`release`). Distillation refuses pp with tp, cp or ep
(suite.distill.checks), so the whole teacher is a plain module there.
"""

from __future__ import annotations

import torch
from torch import nn

from suite.config.schema import SuiteConfig
from suite.distill.hidden import BlockOutputs
from suite.distill.vocab_parallel import vocab_rows
from suite.frozen_model import load_frozen
from suite.model_source import ModelSource
from suite.parallel.dims import ParallelDims
from suite.runtime import PrecisionPolicy


class Teacher:
    def __init__(
        self,
        model: nn.Module,
        head_weight: torch.Tensor,
        source: ModelSource,
        vocab_rows: tuple[int, int] | None = None,
    ):
        self.model = model
        self.head_weight = head_weight  # under tp: only this rank's vocabulary rows
        self.source = source
        self.vocab_rows = vocab_rows or (0, head_weight.shape[0])  # [start, stop) of the vocabulary

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, kwargs: dict, blocks=()) -> tuple[torch.Tensor, dict]:
        """The teacher's final (normed) hidden states [b, s, h_t] for the student's micro-batch, and
        the outputs of its blocks `blocks` by index (hidden-state matching; none by default)."""
        with BlockOutputs(self.model, blocks) as kept:
            final = self.model(tokens, head=lambda hidden, weight: hidden, **kwargs)
        return final, kept.outputs

    def release(self) -> None:
        """Free the weights on a rank that never runs the teacher (a pipeline stage before the last)."""
        self.model.to("meta")
        self.head_weight = self.head_weight.to("meta")


def load_teacher(
    cfg: SuiteConfig, dims: ParallelDims, device: torch.device, precision: PrecisionPolicy
) -> Teacher:
    """The teacher named by distill.teacher, placed like the student and frozen."""
    source = ModelSource.parse(cfg.distill.teacher, "distill.teacher")
    # whole on every rank under pp, plain (module docstring); the loss's last stage runs it
    frozen = load_frozen(cfg, dims, device, precision, source, "distill.teacher", whole=dims.pp > 1)
    model, placement, input_device = frozen.model, frozen.placement, frozen.input_device
    weight = model.output.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # one gather, at setup
    rows = None
    if dims.tp > 1:  # keep the rows of the vocabulary this tp rank's student head holds
        tp_mesh = placement.mesh["tp"]
        rows = vocab_rows(weight.shape[0], tp_mesh.get_local_rank(), tp_mesh.size())
        weight = weight[rows[0] : rows[1]].clone()
    # offload: params on CPU
    return Teacher(model, weight.detach().to(input_device), source, rows)
