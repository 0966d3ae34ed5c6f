"""`train.tensor_memory=true`: the peak bytes of live tensor storage on this rank during the last
training step, the quantity `suite plan` predicts (weights, gradients, optimizer state,
activations), on any device.

A CPU run's `mem_gb` is the process's peak resident set: Python, torch's libraries, gloo's buffers
and the allocator's cached pages included, so it cannot be compared with the planner. This counts
tensor storages instead: every storage alive when the step starts (found through the garbage
collector: parameters, gradients, optimizer state, FSDP's unsharded parameters, batches, buffers)
and every storage an operator creates during it (a TorchDispatchMode). Sizes are re-read at each
operator, so FSDP's in-place storage resizes (all-gather into, and free of, the unsharded
parameters) are seen. Storages are counted once however many views share them; a storage dies when
its last reference does (a weak reference's callback).

Slow (it walks the live storages at every operator): only the last step runs under it, and its time
is not what tokens/s should be read from.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages a tensor holds: its own, or its inner tensors' for a wrapper subclass (DTensor)."""

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
        return []


class TensorMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages on `device` while the mode is active (module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = torch.device(device).type
        self.live: dict[int, weakref.ref] = {}
        self.peak = 0

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live or storage.device.type != self.device_type:
            return
        self.live[key] = weakref.ref(storage, lambda _, key=key: self.live.pop(key, None))

    def _add_tensor(self, t: torch.Tensor) -> None:
        for storage in _storages(t):
            self._add(storage)

    def current(self) -> int:
        """Bytes of the live storages now."""
        total = 0
        for ref in list(self.live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def __enter__(self):
        gc.collect()
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(): no attribute lookup on proxies
                self._add_tensor(obj)
        self.peak = self.current()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten((out, args, kwargs))[0]:  # inputs too: made outside any operator
            if isinstance(value, torch.Tensor):
                self._add_tensor(value)
        self.peak = max(self.peak, self.current())
        return out


def tracked_step(trainer, batches: list) -> tuple:
    """`trainer.train_step(batches)`; the run's last step under TensorMemory when train.tensor_memory
    is set (its peak kept as `trainer.tensor_peak`)."""
    cfg = trainer.cfg.train
    if not (cfg.tensor_memory and trainer.step + 1 == cfg.max_steps):
        return trainer.train_step(batches)
    with TensorMemory(trainer.device) as tracker:
        result = trainer.train_step(batches)
    trainer.tensor_peak = tracker.peak
    return result


def peak_summary(trainer) -> dict:
    """summary.json's `tensor_peak_gb_per_rank` (collective: every rank ran the tracked step), or {}."""
    peak = getattr(trainer, "tensor_peak", None)
    return {} if peak is None else {"tensor_peak_gb_per_rank": trainer._gather_floats(peak / 2**30)}
