"""Writing checkpoints during a run: synchronous or in the background, retention, and one line on failure.

The trainer hands over what a checkpoint holds (suite.train.checkpoint does the atomic write); this
keeps the asynchronous save in flight, completes it (polled every step, at the latest before the
next save, at the end, on SIGTERM and on errors), applies retention on rank 0, and turns a failed
write (full disk: ENOSPC, quota, I/O error) into one `error:` line after removing the temporary
folder, so every earlier checkpoint stays untouched.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from suite.train import checkpoint as ckpt


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError itself, or the first one DCP wrapped into a CheckpointException (any rank's)."""
    if isinstance(exc, OSError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return None


class RunStopped(SystemExit):
    """The run stops with one `error: ...` line (exit 1): no traceback, the message says why."""


class Saver:
    """Checkpoints of one run folder (`async_group`: None single process, False synchronous saves,
    else the gloo group of background writes)."""

    def __init__(
        self,
        run_dir: Path,
        keep_last: int,
        keep_every: int,
        is_main: bool,
        async_group,
        log: Callable,
        fingerprint: dict | None = None,
    ):
        """`fingerprint` (settable later): written into every checkpoint (suite.train.run_folder)."""
        self.run_dir, self.keep_last, self.keep_every = run_dir, keep_last, keep_every
        self.fingerprint = fingerprint
        self.is_main, self.async_group, self.log = is_main, async_group, log
        self.pending: ckpt.PendingSave | None = None

    def save(self, step: int, model, optimizer, state: dict, yaml: str, write_extra=None, wait=False) -> Path:
        """Write a checkpoint of `step` (collective); returns its final folder.

        Synchronous saves return once the checkpoint is complete and retention has run (rank 0).
        With train.async_save the model and optimizer state is copied to CPU memory and written in
        the background while training goes on; `finish_pending` completes it (here when `wait`).
        """
        self.finish_pending()
        try:
            result = ckpt.save_checkpoint(
                self.run_dir,
                step,
                model,
                optimizer,
                state,
                yaml,
                self.async_group,
                write_extra,
                self.fingerprint,
            )
        except (OSError, CheckpointException) as exc:
            self._failed(exc, step)
        if isinstance(result, ckpt.PendingSave):
            self.pending = result
            return self.finish_pending() if wait else result.final
        self._after_save()
        return result

    def finish_pending(self, only_if_done: bool = False) -> Path | None:
        """Complete the asynchronous save in flight, if any (waits for it unless `only_if_done`).

        Not collective. A poll (`only_if_done`) leaves a failed write alone: the failure is raised
        where every rank waits (the next save, the end of the run), so all ranks stop together.
        """
        pending = self.pending
        if pending is None:
            return None
        if only_if_done and not (pending.done() and pending.future.exception() is None):
            return None
        self.pending = None
        try:
            folder = pending.finish()
        except (OSError, CheckpointException) as exc:
            self._failed(exc, pending.step)
        self.log(f"saved checkpoint {folder}")
        self._after_save()
        return folder

    def finish_quietly(self) -> None:
        """On the way out after an error: complete a pending save if it can be; its own failure is
        reported in one line without hiding the error that is already propagating."""
        if self.pending is None:
            return
        try:
            self.finish_pending()
        except BaseException as exc:  # noqa: BLE001 - the first error is the one that propagates
            self.log(str(exc))

    def _after_save(self) -> None:
        if self.is_main:
            ckpt.apply_retention(self.run_dir, self.keep_last, self.keep_every)

    def _failed(self, exc: BaseException, step: int):
        """Stop the run with one line after a failed checkpoint write (re-raises anything else)."""
        err = os_error_in(exc)
        if err is None:
            raise exc
        tmp = ckpt.checkpoint_root(self.run_dir) / f".tmp-{ckpt.STEP_PREFIX}{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        where = err.filename or tmp
        good = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
        raise RunStopped(
            f"error: could not write the checkpoint of step {step} to {where}: "
            f"{err.strerror or err}; last good checkpoint: {good or 'none'}; free space and run the "
            "same command again to resume"
        ) from None
