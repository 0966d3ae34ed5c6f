"""Fault handling around the loop: non-finite steps, loss spikes (rollback) and SIGTERM (preemption).

`StepFaults` counts the steps the optimizer skipped as non-finite (decided by the step, on the device
where it can: their flags are read at the next logging, saving or evaluation step) and stops the run
after train.max_bad_steps in a row; with train.spike_factor > 0 it keeps the window of good losses,
and a spike rolls back to the newest checkpoint in-process, skipping that batch for good. Its counts
and skipped batches travel in every checkpoint (`state_dict`). `Preemption` turns SIGTERM into a flag
that every rank agrees on after a step; the loop then checkpoints and exits 143.
"""

from __future__ import annotations

import signal
import threading
from collections import deque

import torch

from suite.config.schema import TrainConfig
from suite.parallel.env import barrier
from suite.train import checkpoint as ckpt
from suite.train.components import Trainer
from suite.train.saver import RunStopped

SIGTERM_EXIT = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended


class StepFaults:
    """Non-finite steps and loss spikes of one run (module docstring)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.bad_steps = 0  # non-finite steps skipped, in total (this process's run)
        self.bad_in_a_row = 0
        # (step, loss, grad_norm, ok) of steps whose finiteness flag is still on the device
        self.unread: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.loss_window: deque[float] = deque(maxlen=cfg.spike_window)  # spike rollback's good losses
        self.skipped_batches: list[int] = []  # batches a spike rollback never trains on
        self.rollbacks_in_a_row = 0

    # ---- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bad_steps": self.bad_steps, "skipped_batches": list(self.skipped_batches)}

    def load_state_dict(self, state: dict) -> None:
        self.bad_steps = int(state.get("bad_steps", 0))
        self.skipped_batches = sorted(set(self.skipped_batches) | set(state.get("skipped_batches", [])))

    # ---- non-finite steps ---------------------------------------------------------------------
    def record(self, trainer: Trainer, ok, loss: torch.Tensor, grad_norm: torch.Tensor, logger) -> None:
        """Account step `trainer.step`: now, or at the next read when `ok` is still on the device."""
        if isinstance(ok, torch.Tensor):
            self.unread.append((trainer.step, loss, grad_norm, ok))
        else:
            self._count(trainer, trainer.step, ok, loss, grad_norm)

    def read_flags(self, trainer: Trainer) -> None:
        """Account the steps whose finiteness is still on the device (one host read for all)."""
        unread, self.unread = self.unread, []
        if not unread:
            return
        flags = torch.stack([ok for _, _, _, ok in unread]).tolist()
        for (step, loss, grad_norm, _), ok in zip(unread, flags):
            self._count(trainer, step, bool(ok), loss, grad_norm)

    def _count(self, trainer: Trainer, step: int, ok: bool, loss, grad_norm) -> None:
        if ok:
            self.bad_in_a_row = 0
            if self.cfg.spike_factor > 0:
                self.loss_window.append(float(loss))
            return
        self.bad_steps += 1
        self.bad_in_a_row += 1
        limit = self.cfg.max_bad_steps
        trainer.log(
            f"step {step}: loss {float(loss):.4g}, grad norm {float(grad_norm):.4g}: not finite; "
            f"optimizer step skipped ({self.bad_in_a_row} in a row, {self.bad_steps} in total)"
        )
        if self.bad_in_a_row >= limit:
            trainer.checkpoints.finish_pending()
            good = ckpt.latest_checkpoint(trainer.run_dir, log=lambda _: None)
            raise RunStopped(
                f"error: stopping at step {step}: {self.bad_in_a_row} non-finite steps in a row "
                f"(train.max_bad_steps={limit}); last good checkpoint: {good or 'none'}"
            )

    # ---- loss spikes --------------------------------------------------------------------------
    def is_spike(self, loss: float) -> bool:
        """train.spike_factor > 0: the loss exceeds that factor times the mean of the last
        train.spike_window good steps (a full window is needed first)."""
        factor, window = self.cfg.spike_factor, self.loss_window
        return factor > 0 and len(window) == window.maxlen and loss > factor * sum(window) / len(window)

    def rollback(self, trainer: Trainer, loss: torch.Tensor, logger) -> None:
        """A loss spike at the step being run: skip its batch for good and restore the newest
        checkpoint in-process (collective; every rank decided alike). The steps since that
        checkpoint are redone on their own batches; the spiking batch is never trained on."""
        t = self.cfg
        spike_step, batch = trainer.step + 1, trainer.batch_number
        mean = sum(self.loss_window) / len(self.loss_window)
        self.skipped_batches = sorted({*self.skipped_batches, batch})
        self.rollbacks_in_a_row += 1
        self.loss_window.clear()
        what = (
            f"step {spike_step}: loss {float(loss):.4g} is more than train.spike_factor={t.spike_factor:g} x "
            f"the mean {mean:.4g} of the last {t.spike_window} steps"
        )
        if self.rollbacks_in_a_row > t.max_bad_steps:
            good = ckpt.latest_checkpoint(trainer.run_dir, log=lambda _: None)
            raise RunStopped(
                f"error: stopping at {what}, after {t.max_bad_steps} rollbacks without a new checkpoint "
                f"(train.max_bad_steps={t.max_bad_steps}); last good checkpoint: {good or 'none'}"
            )
        trainer.checkpoints.finish_pending()
        barrier()  # rank 0 may just have completed the newest checkpoint: every rank must see it
        folder = ckpt.latest_checkpoint(trainer.run_dir, log=lambda _: None)
        if folder is None:
            trainer.log(f"{what}; no checkpoint to roll back to: skipped batch {batch}, step redone")
            return
        trainer.checkpoints.load(trainer, folder)
        if logger:
            logger.rewind(trainer.step)
        trainer.log(
            f"{what}; rolled back to {folder} (step {trainer.step}) and skipping batch {batch} "
            f"(skipped so far: {self.skipped_batches})"
        )


class Preemption:
    """SIGTERM (Slurm's warning before it kills) noted by a handler, acted on between steps."""

    def __init__(self):
        self.signalled = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True

    def any_rank(self, trainer: Trainer) -> bool:
        """True on every rank when any rank got SIGTERM (collective when distributed)."""
        return trainer.runner.any_ranks(self.signalled)[0]
