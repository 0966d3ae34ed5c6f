"""The tests' fault injection, a trainer component the tests add (suite.train.components: the file
named by SUITE_TEST_COMPONENTS, set by tests/helpers.py:suite_env), so no test hook lives in the loop.

    train.inject_nan_steps=[N]       step N's loss is made NaN (the step is skipped as non-finite)
    train.inject_spike_batches=[B]   the loss of batch B (1-based, data order) x100: a loss spike
    train.fault_kill_rank/step       that rank SIGKILLs itself before that step, first attempt only
    SUITE_FAULT_INF_GRAD="RANK:STEP" an inf in that rank's gradient at that step (an fp16 overflow)
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from suite.parallel.env import barrier
from suite.train.components import Component

INF_GRAD_ENV = "SUITE_FAULT_INF_GRAD"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def inject_inf_gradient(model: torch.nn.Module, step: int) -> None:
    """Inert unless SUITE_FAULT_INF_GRAD="RANK:STEP" names this rank and step: an inf in the gradient
    of this rank's first block weight (not a tied embedding that two stages hold), as an fp16
    overflow in one stage or shard would leave it."""
    value = os.environ.get(INF_GRAD_ENV)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not value or value != f"{rank}:{step}":
        return
    grad = next(
        _local(p.grad)
        for name, p in model.named_parameters()
        if "layers." in name and p.grad is not None and _local(p.grad).numel()
    )
    grad[(0,) * grad.dim()] = float("inf")


class FaultInjection(Component):
    injects_faults = True  # the trainer refuses the train.inject_* / fault_kill_* keys without it

    def before_step(self, trainer) -> None:
        """train.fault_kill_rank SIGKILLs itself before train.fault_kill_step, on the first attempt only
        (SUITE_RESTART_COUNT, set by the launcher's elastic min:max restarts, or else
        TORCHELASTIC_RESTART_COUNT: 0 or unset). An asynchronous save still in flight is completed
        first (every rank), so the test knows which checkpoint the restart finds."""
        t = trainer.cfg.train
        attempt = os.environ.get("SUITE_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if t.fault_kill_step is None or trainer.step + 1 != t.fault_kill_step or attempt != "0":
            return
        if trainer.checkpoints.async_group is not False:
            trainer.checkpoints.finish_pending()
            barrier()
        if trainer.env.rank == t.fault_kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def adjust_loss(self, trainer, loss: torch.Tensor) -> torch.Tensor:
        inject_inf_gradient(trainer.model, trainer.step + 1)
        if trainer.step + 1 in trainer.cfg.train.inject_nan_steps:
            loss = loss * float("nan")
        if trainer.batch_number in trainer.cfg.train.inject_spike_batches:
            loss = loss * 100.0
        return loss


def components(cfg) -> list[Component]:
    return [FaultInjection()]
