"""`train.save_grads_step`: one step's gradients as full tensors, to compare layouts gradient by gradient.

AdamW and clipping hide a gradient that is wrong by a constant factor (summing instead of averaging
over data-parallel ranks leaves losses and weights almost unchanged), so the layout checks compare
the gradients themselves. Each rank writes the parameters it holds, gathered to full tensors
(DTensor shards over tp / sharding / ep), after the backward and the data-parallel reduction and
before clipping, as `<run.dir>/grads/step_<N>/rank<r>.safetensors`. Pipeline stages hold different
parameters, so the union of the rank files is the whole model; a name written by several ranks
must agree (tests/helpers.py: `step_gradients`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn


def grads_folder(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "grads" / f"step_{step}"


@torch.no_grad()
def save_gradients(model: nn.Module, run_dir: Path, step: int) -> Path:
    """Write this rank's gradients of `step` (collective under DTensor: every rank calls it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name] = grad.detach().float().cpu().contiguous()
    folder = grads_folder(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / f"rank{rank}.safetensors"))
    return folder
