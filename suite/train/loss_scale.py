"""fp16's dynamic loss scaling (train.precision=fp16) for every layout: torch's GradScaler with its
overflow check taken over the gradients the model holds and reduced over the whole world.

torch.amp.GradScaler unscales and checks the gradients of the optimizer's parameters, in one process.
Two things differ here:

- the ZeRO-1 and fp32-master optimizers (suite.train.optim.WrappedOptimizer) update other tensors
  than the model's parameters, whose gradients exist only inside their step: the model's gradients
  are what is unscaled and checked (before, ZeRO-1 would have found no gradient to check);
- each rank holds only part of the gradients (a pipeline stage's layers, a tp or FSDP shard, its
  copy after a dp all-reduce), so an inf on one rank must make every rank skip the step and halve
  the scale alike: the found-inf flag is all-reduced (MAX) over every rank of the world, on the
  device, once per step. DTensor gradients are checked through their local tensors.

TrainStep (suite.train.step) calls `unscale_`, `step` and `update` as with torch's GradScaler (`step`
skips on the flag, `update` backs off), so one process and every layout take the same decisions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from suite.runtime import PrecisionPolicy
from suite.train.wrapped_optim import WrappedOptimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def local_gradients(optimizer) -> Iterator[torch.Tensor]:
    """The gradients the step will apply, as this rank holds them (local tensors, each once): the
    model's for a WrappedOptimizer (ZeRO-1 slices them inside its step), else the optimizer's."""
    if isinstance(optimizer, WrappedOptimizer):
        params = optimizer.model.parameters()
    else:
        params = (p for group in optimizer.param_groups for p in group["params"])
    seen: set[int] = set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            yield _local(p.grad)


class LossScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose overflow flag covers every rank (see the module doc). Its scale
    exists from the start on `device`: pipeline stages without the loss never call `scale()`."""

    def __init__(self, device: torch.device, enabled: bool):
        super().__init__(device.type, enabled=enabled)
        if self._enabled:
            self._lazy_init_scale_growth_tracker(device)

    def _unscale_grads_(
        self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for grad in local_gradients(optimizer):
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            groups[(grad.device, grad.dtype)].append(grad)
        with torch.no_grad():
            for (device, _), grads in groups.items():
                flag = torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
                found_inf += flag.to(found_inf.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # one rank's overflow is every rank's
        return {found_inf.device: found_inf}


def loss_scaler(device: torch.device, precision: PrecisionPolicy) -> LossScaler:
    """The step's scaler: enabled for fp16 (PrecisionPolicy.grad_scaler), a pass-through otherwise."""
    return LossScaler(device, enabled=precision.grad_scaler)


SCALER_KEY = "loss_scaler"  # in the checkpoint's trainer_state.pt


def scaler_state(scaler: LossScaler) -> dict:
    """What a checkpoint keeps of an fp16 scaler: its scale and growth tracker (the same on every
    rank: the overflow flag is the world's), so a resumed run goes on with the scale it had
    reached instead of starting again at 2^16. Nothing when the scaler is off (bf16 / fp32)."""
    if not scaler.is_enabled():
        return {}
    full = scaler.state_dict()
    return {SCALER_KEY: {"scale": full["scale"], "growth_tracker": full["_growth_tracker"]}}


def restore_scaler(scaler: LossScaler, trainer_state: dict) -> None:
    """Put back `scaler_state` from a checkpoint's trainer state. A checkpoint without it (saved
    before it was kept, or by a bf16 / fp32 run) leaves the scaler at its initial scale."""
    saved = trainer_state.get(SCALER_KEY)
    if saved is None or not scaler.is_enabled():
        return
    full = scaler.state_dict()
    scaler.load_state_dict({**full, "scale": saved["scale"], "_growth_tracker": saved["growth_tracker"]})
