"""Checkpoints that cannot be half-written, readable by every parallel layout.

Layout of `<run.dir>/checkpoints/step_<N>/`:
    model + optimizer   torch.distributed.checkpoint (DCP) files: any layout saves, any layout loads
    trainer_state.pt    step, data position (tensors and ints only: loads with weights_only=True)
    rng_rank<r>.pt      each rank's RNG state, for bitwise resume
    config.yaml         the resolved config of the run that wrote it
    fingerprint.json    what a config must share to resume it (suite.train.run_folder)
    manifest.json       every file with size and sha256, written last
The folder is written under a temporary name and renamed into place; `checkpoints/latest` names
the newest complete checkpoint and changes only after the rename.

Asynchronous saves (`train.async_save=true`) copy the state to CPU memory, write the DCP files in a
background thread (DCP's `async_save`, over a process group of their own) and return a
`PendingSave`; the manifest, fsync, rename and `latest` happen when that write has finished, with
the same guarantees as a synchronous save.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from suite.config.errors import ConfigError

# DCP warns on every single-process save/load that it is "assuming the intent"; that intent is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
FINGERPRINT = "fingerprint.json"  # what a resume must match (suite.train.run_folder)
ENOSPC_ENV = "SUITE_FAULT_ENOSPC_STEP"
KILL_IN_SAVE_ENV = "SUITE_FAULT_KILL_IN_SAVE_STEP"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def verify(folder: Path) -> str | None:
    """None when every file the manifest lists is there with its size and checksum; else why not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"{folder} has no {MANIFEST} (an interrupted save?)"
    try:
        listed = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return f"{manifest} is not a valid manifest"
    for name, info in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != info["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {info['bytes']}"
        if _sha256(path) != info["sha256"]:
            return f"{path} does not match its checksum"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[5:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def named_latest(run_dir: Path) -> Path | None:
    """The checkpoint folder `checkpoints/latest` names (None without one): the last one committed,
    which is what the folder holds, whatever other step numbers lie beside it."""
    try:
        name = (checkpoint_root(run_dir) / "latest").read_text().strip()
    except OSError:
        return None
    ok = name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit()
    return checkpoint_root(run_dir) / name if ok else None


def latest_checkpoint(run_dir: Path, log=print) -> Path | None:
    """The checkpoint `latest` names when it verifies, else the newest one below it that does (a
    broken one is reported in one line and skipped); without `latest`, the newest that verifies.
    Never a higher step than `latest`'s: one that was not committed last is not the folder's."""
    found = list_checkpoints(run_dir)
    named = named_latest(run_dir)
    if named is not None:
        bound = int(named.name[len(STEP_PREFIX) :])
        found = [p for p in found if int(p.name[len(STEP_PREFIX) :]) <= bound]
    for folder in reversed(found):
        problem = verify(folder)
        if problem is None:
            return folder
        log(f"skipping checkpoint {folder.name}: {problem}")
    return None


def find_checkpoint(path: str | Path) -> tuple[Path, list[str]]:
    """The checkpoint folder that `path` names, verified against its manifest, and the checkpoints
    skipped on the way (one line each): `path` is a run folder (its newest checkpoint that
    verifies), its `checkpoints/` folder, or a `step_<N>` folder (which must verify itself).
    Raises ConfigError with the reason (the caller names the key)."""
    path = Path(path).expanduser()
    if path.name == checkpoint_root(path.parent).name and (path / "latest").is_file():
        path = path.parent  # <run.dir>/checkpoints: the run folder
    step_folder = (path / MANIFEST).is_file() or (
        path.name.startswith(STEP_PREFIX) and path.parent.name == "checkpoints"
    )
    if step_folder:
        if not path.is_dir():
            raise ConfigError(f"{path} does not exist")
        problem = verify(path)
        if problem is not None:
            raise ConfigError(
                f"checkpoint {path.name} does not verify ({problem}); name another step or the run "
                f"folder {path.parent.parent} (its newest checkpoint that verifies)"
            )
        return path, []
    skipped: list[str] = []
    if checkpoint_root(path).is_dir():
        found = latest_checkpoint(path, log=skipped.append)
        if found is not None:
            return found, skipped
        if skipped:
            raise ConfigError(f"no checkpoint of {path} verifies: {'; '.join(skipped)}")
    raise ConfigError(
        "neither a run folder with a checkpoint nor a checkpoint folder "
        "(expected <run.dir> or <run.dir>/checkpoints/step_<N>)"
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder (its newest good checkpoint) or a checkpoint folder that verifies."""
    try:
        return find_checkpoint(path)[0]
    except ConfigError as exc:
        raise ConfigError(f"ckpt='{path}': {exc}") from None


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint folder holds (its manifest's)."""
    try:
        return int(json.loads((folder / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return int(folder.name[len(STEP_PREFIX) :])


class _WriteErrors(FileSystem):
    """DCP's file system, keeping the first OSError that a write to one of its files raised.

    DCP writes every tensor with torch.save into the open file; when the disk fills, Python's write
    raises OSError(ENOSPC), but torch.save's C++ zip writer swallows it and raises a bare
    `RuntimeError: ... unexpected pos`, which would not read as a full disk. `_Writer` raises the
    kept OSError instead."""

    def __init__(self) -> None:
        super().__init__()
        self.error: OSError | None = None

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _KeepWriteErrors(stream, path, self) if "w" in mode else stream


class _KeepWriteErrors:
    """A file that tells `keeper` of the OSError its write or flush raised, naming the file (and
    still raises it)."""

    def __init__(self, stream, path, keeper: _WriteErrors):
        self._stream, self._path, self._keeper = stream, path, keeper

    def _keep(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            if self._keeper.error is None:
                self._keeper.error = OSError(
                    exc.errno, exc.strerror or str(exc), exc.filename or str(self._path)
                )
            raise

    def write(self, data):
        return self._keep(self._stream.write, data)

    def flush(self):
        return self._keep(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer whose failed writes raise the OSError behind them (see `_WriteErrors`), with
    two fault-injection aids for tests, inert unless their environment variable names this step:
    `SUITE_FAULT_ENOSPC_STEP=N` fails the save of step N as a full disk would, and
    `SUITE_FAULT_KILL_IN_SAVE_STEP=N` SIGKILLs the process in the middle of that save (in the
    background thread when the save is asynchronous). Both act after this rank's model files are
    written and before the save is complete."""

    def __init__(self, path: Path, step: int):
        super().__init__(str(path))
        self.fs = _WriteErrors()
        self.step = str(step)

    def write_data(self, plan, planner):
        try:
            written = super().write_data(plan, planner)
        except Exception as exc:
            if isinstance(exc, OSError) or self.fs.error is None:
                raise
            raise self.fs.error from exc
        if os.environ.get(KILL_IN_SAVE_ENV) == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get(ENOSPC_ENV) == self.step:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {ENOSPC_ENV})", self.path)
        return written


class PendingSave:
    """An asynchronous save in flight: `done()` polls, `finish()` waits and completes it.

    The DCP write coordinates its ranks itself: when it has finished on rank 0, every rank's files
    are written. Completing the checkpoint (manifest, fsync, rename, `latest`) is then rank 0's
    alone, so neither call is collective and either may run at any point of the loop. A failed
    write raises from `finish()` on every rank (DCP reports one rank's failure to all).
    """

    def __init__(self, step: int, tmp: Path, final: Path, future: Future):
        self.step, self.tmp, self.final, self.future = step, tmp, final, future

    def done(self) -> bool:
        return self.future.done()

    def finish(self) -> Path:
        self.future.result()
        if _rank() == 0:
            commit(self.tmp, self.final, self.step)
        return self.final


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    config_yaml: str,
    async_group: dist.ProcessGroup | None | bool = False,
    write_extra: Callable[[Path], None] | None = None,
    fingerprint: dict[str, Any] | None = None,
) -> Path | PendingSave:
    """Collective: every rank calls it. Returns the final folder, or a `PendingSave` when
    `async_group` is given (a gloo process group reserved for checkpoint writes; None when the
    run is a single process; False: save synchronously).

    write_extra(folder): rank 0 writes more files into the checkpoint (LoRA adapters) before the
    manifest, so they are checksummed and appear atomically with the rest.
    """
    root = checkpoint_root(run_dir)
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp-{STEP_PREFIX}{step}"
    with _RankLocalWrites() as local:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    local.check()  # every rank, after rank 0 made the folder (a barrier)
    state = _training_state(model, optimizer)
    # the small files capture this step's state now, before training moves on
    with _RankLocalWrites() as local:
        rng = {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        _torch_save(rng, tmp / f"rng_rank{_rank()}.pt")
        if _rank() == 0:
            _torch_save(trainer_state, tmp / "trainer_state.pt")
            _write_bytes(tmp / "config.yaml", config_yaml.encode())
            if fingerprint is not None:
                _write_bytes(tmp / FINGERPRINT, (json.dumps(fingerprint, indent=1) + "\n").encode())
            if write_extra is not None:
                write_extra(tmp)
    local.check()
    if async_group is not False:
        # the state is copied to CPU memory here; the files are written by a background thread
        future = dcp.async_save(state, storage_writer=_Writer(tmp, step), process_group=async_group)
        return PendingSave(step, tmp, final, future)
    dcp.save(state, storage_writer=_Writer(tmp, step))
    _barrier()
    with _RankLocalWrites() as local:
        if _rank() == 0:
            commit(tmp, final, step)
    local.check()  # the others wait for rank 0's commit, and hear of its failure
    return final


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through Python's file writes: a full disk raises OSError(ENOSPC) naming the file,
    where torch.save(obj, path) raises a bare RuntimeError from its C++ stream."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_bytes(path, buffer.getvalue())


def _write_bytes(path: Path, data: bytes) -> None:
    """path.write_bytes, with the file named in the OSError of a failed write (a full disk)."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), exc.filename or str(path)) from exc


class _RankLocalWrites:
    """Rank-local writes whose OSError (a full disk, a quota, an I/O error) every rank must hear of:
    `with _RankLocalWrites() as local: <writes>` keeps the error, and `local.check()` (collective)
    raises an OSError on every rank when any rank failed: the failing rank's own, an equal one on the
    others. Without it the other ranks would go on into the next collective and fail there on a
    closed connection, with a traceback instead of the one-line full-disk message."""

    def __enter__(self) -> _RankLocalWrites:
        self.error: OSError | None = None
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, OSError):
            self.error = exc
            return True
        return False

    def check(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if self.error is not None:
                raise self.error
            return
        err = self.error
        mine = None if err is None else (err.errno, err.strerror or str(err), err.filename)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if self.error is not None:
            raise self.error
        first = next((e for e in every if e is not None), None)
        if first is not None:
            raise OSError(*first)


def commit(tmp: Path, final: Path, step: int) -> None:
    """The one commit of every checkpoint any verb writes (training, quantize, prune), rank 0, once
    every file is written into `tmp`: manifest, fsync, rename to `final`, then `latest` atomically."""
    write_manifest(tmp, step)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = final.parent / ".latest.tmp"
    with latest_tmp.open("w") as handle:
        handle.write(final.name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(latest_tmp, final.parent / "latest")
    _fsync_dir(final.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_folder(run_dir: Path, step: int) -> tuple[Path, Path]:
    """(temporary, final) folders of checkpoint `step`: the temporary one made empty, for a writer
    that fills it and then calls `commit`."""
    root = checkpoint_root(run_dir)
    final, tmp = root / f"{STEP_PREFIX}{step}", root / f".tmp-{STEP_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp, final


def apply_retention(run_dir: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete old checkpoints (rank 0, after a successful save); returns what was deleted.

    Kept: the `keep_last` newest (all when 0), every step that is a multiple of `keep_every` (when
    > 0), and always the newest checkpoint that verifies, whatever the two settings say. Stale
    `.tmp-step_*` folders (saves that never finished) are removed too.
    """
    found = list_checkpoints(run_dir)
    keep = set(found[-keep_last:] if keep_last > 0 else found)
    if keep_every > 0:
        keep |= {p for p in found if int(p.name[len(STEP_PREFIX) :]) % keep_every == 0}
    doomed = [p for p in found if p not in keep]
    if doomed:
        newest_good = latest_checkpoint(run_dir, log=lambda _: None)
        doomed = [p for p in doomed if p != newest_good]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    root = checkpoint_root(run_dir)
    for stale in root.glob(f".tmp-{STEP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return doomed


def _training_state(model: nn.Module, optimizer) -> dict[str, Any]:
    """What DCP saves: FQN-keyed model and optimizer state, DTensors in their global layout.

    Any layout's state has the same keys, so DCP reshards on load (saved at sharding=4, resumed at
    tp=2 x dp=2). An optimizer with `dcp_state_dict` (ZeRO-1) provides its own, in the same format.
    """
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    if hasattr(optimizer, "dcp_state_dict"):
        optim_sd = _merge_param_groups(optimizer.dcp_state_dict())
        return {"model": _model_state(model, optimizer), "optim": optim_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": _merge_param_groups(optim_sd)}


def _model_state(model: nn.Module, optimizer) -> dict[str, Any]:
    """The model's DCP state; an optimizer with fp32 master weights (train.param_dtype=bf16) gives
    its masters under the model's names instead: they, not the bf16 copies, are the saved truth."""
    if hasattr(optimizer, "dcp_model_state_dict"):
        return optimizer.dcp_model_state_dict()
    return get_model_state_dict(model)


def _merge_param_groups(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Make `param_groups` (parameter FQN lists: saved once, by one rank) the same on every rank.

    (pipeline) Pipeline stages hold different parameters, so each rank's groups list only its own
    FQNs; DCP would keep one rank's lists and the others could not find their hyper-parameters on
    load. The union over ranks lists every FQN. A no-op when all ranks hold the same parameters.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or "param_groups" not in optim_sd:
        return optim_sd
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [list(g["params"]) for g in optim_sd["param_groups"]])
    groups = []
    for i, group in enumerate(optim_sd["param_groups"]):
        merged = dict.fromkeys(name for lists in gathered if i < len(lists) for name in lists[i])
        groups.append({**group, "params": list(merged)})
    return {**optim_sd, "param_groups": groups}


# param_group options that loading would set to the saving run's, but that belong to how this process
# built its optimizer: `fused`/`foreach` to its layout (a tp=2 run's DTensor params are not fused, a
# resumed single-process run's are), `lr_ratio` (QAT's learned scales) to its compress.scale_lr
BUILT_OPTIONS = ("fused", "foreach", "lr_ratio")


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Collective: load model (+ optimizer) into whatever layout they have now; returns trainer state."""
    if optimizer is not None and hasattr(optimizer, "dcp_state_dict"):
        # an optimizer that owns its sharded state (ZeRO-1): same keys as get_state_dict writes
        state = {"model": _model_state(model, optimizer), "optim": optimizer.dcp_state_dict(for_loading=True)}
        dcp.load(state, checkpoint_id=str(folder))
        if hasattr(optimizer, "sync_params"):  # fp32 masters were loaded in place: round them into the model
            optimizer.sync_params()
        else:
            set_model_state_dict(model, state["model"])
        optimizer.dcp_load_state_dict(state["optim"])
    elif optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder))
        built = [{k: group[k] for k in BUILT_OPTIONS if k in group} for group in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, options in zip(optimizer.param_groups, built):
            group.update(options)
    else:
        load_model_weights(folder, model)
    rng_file = folder / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return torch.load(folder / "trainer_state.pt", weights_only=True)


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Model weights only (generation, export, finetuning from a pretrained run)."""
    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=str(folder))
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
