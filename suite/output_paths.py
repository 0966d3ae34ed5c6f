"""Where a verb writes (run.dir, export.out, data.path, a report's out, a `suite config cp` destination),
checked before anything is written: a folder that can be created or reused, never a file, never someone
else's folder, and a place the suite can really write (tried, not guessed), so /proc or a read-only
mount is one line, not a traceback halfway through."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from suite.config.errors import ConfigError
from suite.folders import new_folder


def _try_write(folder: Path) -> str | None:
    """Why nothing can be created in `folder`, or None: a real try (permissions, read-only and virtual
    file systems such as /proc, where os.access says yes to root), undone at once: the folder's times
    too, so a refusal that follows leaves it byte for byte and time for time as it was."""
    try:
        before = os.stat(folder)
        os.rmdir(tempfile.mkdtemp(prefix=".suite-check-", dir=folder))
        os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # the folder exists: a virtual file system refusing new entries
            return "it takes no new folders"
        return exc.strerror or type(exc).__name__
    return None


def _creatable(key: str, value: str, path: Path, fix: str) -> None:
    """`path` does not exist: its nearest existing parent must be a folder we can write in."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}='{value}' cannot be created: {parent} is a file, not a folder; {fix}")
    reason = _try_write(parent)
    if reason:
        raise ConfigError(f"{key}='{value}' cannot be created: {parent} is not writable ({reason}); {fix}")


def check_replaceable(key: str, value: str, fix: str) -> Path:
    """A folder a verb builds beside itself and then moves into place (`suite prepare`): whether or not
    it exists, its parent (or the nearest existing ancestor) must take a new entry."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}='{value}' is a file, not a folder; {fix}")
    _creatable(key, value, path, fix)
    return path


def check_output_folder(
    key: str, value: str | None, fix: str, owned_marker: str | tuple[str, ...] | None = None
) -> Path:
    """A folder a verb creates or reuses. `owned_marker`: a file (or any of several) that marks a
    folder the verb wrote before (reused); any other non-empty folder is refused so nothing is mixed
    into it."""
    if value is None or not str(value).strip():
        raise ConfigError(f"{key} is empty; {fix}")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}='{value}' is a file, not a folder; {fix}")
    if not path.exists():
        _creatable(key, value, path, fix)
        return path
    reason = None if os.access(path, os.W_OK | os.X_OK) else "permission denied"
    reason = reason or _try_write(path)
    if reason:
        raise ConfigError(f"{key}='{value}' is not writable ({reason}); {fix}")
    markers = (owned_marker,) if isinstance(owned_marker, str) else owned_marker
    if markers and any(path.iterdir()) and not any((path / m).exists() for m in markers):
        raise ConfigError(
            f"{key}='{value}' is not empty and was not written by suite (no {markers[0]}); {fix}, "
            "so nothing of yours is mixed or overwritten"
        )
    return path


def check_run_dir(run_dir: str, max_steps: int | None = None, resume: bool = True) -> Path:
    """run.dir: a folder that can hold the run (created by the trainer, not here); a run resumed
    there must not have gone past train.max_steps already (`resume`: false with train.resume=false,
    which the run folder's own check refuses, or with train.overwrite=true, which starts clean)."""
    fix = "give a new or earlier run's folder, e.g. run.dir=runs/my-run"
    path = check_output_folder("run.dir", run_dir, fix)
    latest = path / "checkpoints" / "latest"
    if resume and max_steps is not None and latest.is_file():
        name = latest.read_text().strip().removeprefix("step_")
        step = int(name) if name.isdigit() else None
        if step is not None and step > max_steps:
            raise ConfigError(
                f"train.max_steps={max_steps} is below step {step}, which run.dir='{run_dir}' already "
                f"reached; pass a larger train.max_steps (e.g. train.max_steps={2 * step}) to train on, or "
                f"run.dir={new_folder(path)} (a new folder) to start over, or train.overwrite=true to move that run "
                f"aside ({path}.old-N) and start over"
            )
    return path


def check_new_file(key: str, value: str, fix: str) -> Path:
    """A file to create that must not replace one (a copied recipe the user may have edited)."""
    path = Path(value).expanduser()
    if path.exists():
        raise ConfigError(f"{key}='{value}' already exists; {fix}")
    if not path.parent.is_dir():
        raise ConfigError(f"{key}='{value}': no such folder {path.parent}; create it first or {fix}")
    _creatable(key, value, path, fix)
    return path
