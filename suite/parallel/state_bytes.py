"""Per-rank memory accounting of model state: parameters, gradients, optimizer state.

Light on imports (no DTensor / FSDP import) so the single-process path stays quick to start.
A DTensor counts its local shard only (`_local_tensor`), which is what the rank holds.
"""

from __future__ import annotations

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for `t` (its local shard for a DTensor)."""
    if t is None:
        return 0
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters registered on the model right now, on this rank.

    Under FSDP2 the registered tensors are the gathered (unsharded) ones between forward and
    backward where the stage keeps them, and the local shards otherwise.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p)
    return total


def gradient_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p.grad)
    return total


def optimizer_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (AdamW: exp_avg, exp_avg_sq)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += tensor_bytes(value)
    return total
