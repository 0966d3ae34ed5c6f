"""The run's checkpoints as a component of the loop: what a checkpoint holds besides the model and
optimizer (step, data position, fault counts, the fp16 loss scale), saving through
suite.train.saver (atomic, optionally in the background) and resuming from the newest one that
verifies (suite.train.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from suite.train import checkpoint as ckpt
from suite.train.components import Trainer
from suite.train.loss_scale import restore_scaler, scaler_state
from suite.train.saver import Saver


class Checkpointer:
    def __init__(self, trainer: Trainer, fingerprint: dict):
        t = trainer.cfg.train
        # async saves' own gloo group (not interleaved with training's); None: single process; False: sync
        self.async_group = False
        if t.async_save:
            self.async_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.saver = Saver(
            trainer.run_dir, t.keep_last, t.keep_every, trainer.env.is_main, self.async_group, trainer.log
        )
        self.saver.fingerprint = fingerprint
        self.resumed = False

    @property
    def pending(self):
        return self.saver.pending

    def save(self, trainer: Trainer, wait: bool = False) -> Path:
        """Write a checkpoint of this step (collective; suite.train.saver); returns its final folder."""
        state = {
            "step": trainer.step,
            "data": trainer.loader.state_dict(),
            **trainer.faults.state_dict(),
            "world_size": trainer.env.world_size,
            **scaler_state(trainer.scaler),
        }
        extras = [x for x in (c.checkpoint_extra(trainer) for c in trainer.components) if x is not None]
        extra = (lambda folder: [write(folder) for write in extras]) if extras else None
        folder = self.saver.save(
            trainer.step, trainer.model, trainer.optimizer, state, trainer.public_yaml, extra, wait
        )
        trainer.faults.rollbacks_in_a_row = 0
        return folder

    def load(self, trainer: Trainer, folder: Path) -> dict:
        """Model, optimizer, RNG, step and data position from `folder` (collective)."""
        state = ckpt.load_checkpoint(folder, trainer.model, trainer.optimizer)
        trainer.step = int(state["step"])
        trainer.faults.load_state_dict(state)
        trainer.loader.load_state_dict(state["data"])
        restore_scaler(trainer.scaler, state)  # fp16: the loss scale and its growth tracker
        return state

    def resume(self, trainer: Trainer) -> None:
        folder = ckpt.latest_checkpoint(trainer.run_dir, log=trainer.log)
        if folder is None:
            return
        state = self.load(trainer, folder)
        self.resumed = True
        saved, now = int(state.get("world_size", trainer.env.world_size)), trainer.env.world_size
        note = f" (saved by {saved} processes, resharded to {now})" if saved != now else ""
        trainer.log(f"resumed from {folder} at step {trainer.step}{note}")

    def finish_pending(self, only_if_done: bool = False) -> Path | None:
        return self.saver.finish_pending(only_if_done)

    def finish_quietly(self) -> None:
        self.saver.finish_quietly()
