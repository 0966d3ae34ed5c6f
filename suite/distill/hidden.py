"""Hidden-state matching (distill.hidden_weight > 0): the student's block outputs against the teacher's.

Student block i (of S) is matched to teacher block (i + 1) * T // S - 1 (of T): evenly spaced, the
last to the last (a student with half the teacher's layers: blocks 0, 1 against the teacher's 1, 3).
Per target token and matched pair, with s the student block's output (projected to the teacher's width
when the widths differ) and t the teacher's:

    distill.hidden_loss = cosine: 1 - cos(s, t) | mse: mean over the teacher's width of (s - t)^2

averaged over the pairs and added, times distill.hidden_weight, to the token's distillation loss (so
it is weighted over the global batch like every token's loss, in any layout).

The projections (one bias-free nn.Linear per student block, student width -> teacher width) are a
submodule of the student, `distill_proj`, attached before parallelize like LoRA adapters: the
optimizer trains them, FSDP shards them with the root's parameters, checkpoints hold them, so resume
is exact. They are no part of the student: the model's own forward never calls them, and reading the
run's weights (eval, generate, export, model.init_from) leaves them out (suite.model_source.TRAINING_ONLY).
Block outputs are captured with forward hooks; the models hold no distillation code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from suite.data.batch import IGNORE_INDEX
from suite.model_source import TRAINING_ONLY

HIDDEN_LOSSES = ("cosine", "mse")
HIDDEN_SCHEDULES = ("constant", "linear")
PROJECTIONS = TRAINING_ONLY[0].rstrip(".")  # the student's attribute holding the projections


def layer_pairs(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student block, teacher block) for every student block, the teacher's evenly spaced."""
    return [(i, max(0, (i + 1) * teacher_layers // student_layers - 1)) for i in range(student_layers)]


def hidden_weight_at(weight: float, schedule: str, step: int, max_steps: int) -> float:
    """The hidden-state term's weight at 0-based `step`: constant, or linear from `weight` at the first
    step to 0 at the last (a student held to the teacher's blocks to the end plateaus above what the
    hard labels alone reach; docs/benchmarks.md, distillation with hidden-state matching)."""
    if schedule == "constant" or max_steps <= 1:
        return weight
    if schedule == "linear":
        return weight * max(0.0, 1.0 - step / (max_steps - 1))
    raise ValueError(f"distill.hidden_schedule={schedule!r}; use one of {', '.join(HIDDEN_SCHEDULES)}")


def attach_projections(model: nn.Module, student_width: int, teacher_width: int) -> None:
    """Give the (meta-device) student its learned projections, when the widths differ."""
    if student_width == teacher_width:
        return
    device = next(model.parameters()).device
    layers = len(model.layers)
    with torch.device(device):
        setattr(
            model,
            PROJECTIONS,
            nn.ModuleList(nn.Linear(student_width, teacher_width, bias=False) for _ in range(layers)),
        )


def token_losses(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """[tokens] loss of fp32 hidden states [tokens, width] against the teacher's."""
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(student, teacher, dim=-1, eps=1e-8)
    if kind == "mse":
        return (student - teacher).pow(2).mean(-1)
    raise ValueError(f"distill.hidden_loss={kind!r}; use one of {', '.join(HIDDEN_LOSSES)}")


def hidden_loss(
    student: dict[int, torch.Tensor],
    teacher: dict[int, torch.Tensor],
    pairs: list[tuple[int, int]],
    projections: nn.ModuleList | None,
    targets: torch.Tensor,
    kind: str,
) -> torch.Tensor:
    """Summed over the target tokens, averaged over the pairs: block outputs [b, s, h] by block index
    (the student's with their graph, the teacher's detached); `projections[i]` maps student block i."""
    keep = (targets != IGNORE_INDEX).flatten()
    total = torch.zeros((), device=targets.device)
    for s, t in pairs:
        h = student[s].flatten(0, -2)
        if projections is not None:
            h = projections[s](h)
        per_token = token_losses(h.float(), teacher[t].detach().flatten(0, -2).float(), kind)
        total = total + torch.where(keep, per_token, 0.0).sum()
    return total / len(pairs)


class BlockOutputs:
    """`with BlockOutputs(model, blocks) as out:` keeps, in `out.outputs`, the outputs of the
    model's blocks `blocks` (indices into model.layers) of each forward run inside the block."""

    def __init__(self, model: nn.Module, blocks) -> None:
        self.model = model
        self.blocks = sorted(set(blocks))
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> BlockOutputs:
        for i in self.blocks:
            self.handles.append(self.model.layers[str(i)].register_forward_hook(self._keeper(i)))
        return self

    def _keeper(self, i: int):
        def keep(module, args, output) -> None:
            self.outputs[i] = output

        return keep

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
