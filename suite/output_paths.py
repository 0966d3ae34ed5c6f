"""Where a verb writes (run.dir, export.out, data.path, a report's out, a `suite config cp` destination),
checked before anything is written: a folder that can be created or reused, never a file, never someone
else's folder, and a place the suite can really write (tried, not guessed), so /proc or a read-only
mount is one line, not a traceback halfway through.

A refusal's `fix` names the value to type: `{folder}` in it is replaced by a folder that would work
(`instead`): the first free `<folder>-<N>` beside the refused one, or where nothing can be written
there (/proc, a read-only mount), the same name in the current folder (or the temporary folder)."""

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


def _existing_parent(path: Path) -> Path:
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def instead(path: str | Path) -> Path:
    """A folder to type in place of `path`, which is refused (a file, someone else's folder, a place
    that cannot be written), or `path` itself where it is free: the first free `<path>-<N>` beside it
    where that can be created, else
    `<name>` (or the first free `<name>-<N>`) in the current folder, or in the temporary folder."""
    path = Path(path).expanduser()
    parent = _existing_parent(path)
    if parent.is_dir() and _try_write(parent) is None:
        return new_folder(path) if path.exists() else path
    name = path.name or "suite-out"
    for base in (Path.cwd(), Path(tempfile.gettempdir())):
        if _try_write(base) is None:
            candidate = Path(name) if base == Path.cwd() else base / name
            return new_folder(candidate) if candidate.exists() else candidate
    return new_folder(path)


def _fill(fix: str, path: Path) -> str:
    """`fix` with `{folder}` replaced by the folder that would work instead of `path`."""
    return fix.replace("{folder}", str(instead(path))) if "{folder}" in fix else fix


def _creatable(key: str, value: str, path: Path, fix: str) -> None:
    """`path` does not exist: its nearest existing parent must be a folder we can write in."""
    parent = _existing_parent(path)
    if not parent.is_dir():
        raise ConfigError(
            f"{key}='{value}' cannot be created: {parent} is a file, not a folder; {_fill(fix, path)}"
        )
    reason = _try_write(parent)
    if reason:
        raise ConfigError(
            f"{key}='{value}' cannot be created: {parent} is not writable ({reason}); {_fill(fix, path)}"
        )


def check_replaceable(key: str, value: str, fix: str) -> Path:
    """A folder a verb builds beside itself and then moves into place (`suite prepare`): whether or not
    it exists, its parent (or the nearest existing ancestor) must take a new entry."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}='{value}' is a file, not a folder; {_fill(fix, path)}")
    _creatable(key, value, path, fix)
    return path


def check_output_folder(
    key: str, value: str | None, fix: str, owned_marker: str | tuple[str, ...] | None = None
) -> Path:
    """A folder a verb creates or reuses. `owned_marker`: a file (or any of several) that marks a
    folder the verb wrote before (reused); any other non-empty folder is refused so nothing is mixed
    into it. `fix`: what would work, `{folder}` in it the folder to type instead (module docstring)."""
    if value is None or not str(value).strip():
        raise ConfigError(f"{key} is empty; {_fill(fix, Path('runs') / 'run')}")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}='{value}' is a file, not a folder; {_fill(fix, path)}")
    if not path.exists():
        _creatable(key, value, path, fix)
        return path
    reason = None if os.access(path, os.W_OK | os.X_OK) else "permission denied"
    reason = reason or _try_write(path)
    if reason:
        raise ConfigError(f"{key}='{value}' is not writable ({reason}); {_fill(fix, path)}")
    markers = (owned_marker,) if isinstance(owned_marker, str) else owned_marker
    if markers and any(path.iterdir()) and not any((path / m).exists() for m in markers):
        raise ConfigError(
            f"{key}='{value}' is not empty and was not written by suite (no {markers[0]}); {_fill(fix, path)}, "
            "so nothing of yours is mixed or overwritten"
        )
    return path


def check_run_dir(run_dir: str, max_steps: int | None = None, resume: bool = True) -> Path:
    """run.dir: a folder that can hold the run (created by the trainer, not here); a run resumed
    there must not have gone past train.max_steps already (`resume`: false with train.resume=false,
    which the run folder's own check refuses, or with train.overwrite=true, which starts clean)."""
    fix = "give a new or earlier run's folder, e.g. run.dir={folder}"
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
