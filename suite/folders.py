"""One rule for every folder a verb writes: it records what made it, and a rerun into it either
continues that same thing or refuses in one line, writing nothing.

Training run folders record it in every checkpoint (`fingerprint.json`, suite.train.run_folder);
every other folder (quantize, prune, export, report, pipeline) in `made_by.json`:

    {"verb": "quantize", "source": "<checkpoint folder> (manifest sha256 <...>)",
     "settings": {"compress.method": "int4", "compress.group_size": 32, ...}}

`source` is the model (or runs) it was made from, as resolved on disk (never as typed, so
`runs/a` and `./runs/a` are one source, and a source retrained in place is another one); `settings`
the keys that define the artefact (not how it is measured or where it runs). Before a verb writes,
`claim` compares the folder's record with the command's: the same, or a new or empty folder, goes on;
anything else is refused naming the difference and the two ways on, each as something to type (the
first free `<folder>-<N>`, the switch): a new folder, or the verb's overwrite switch, which moves the
old content aside to `<folder>.old-<N>` (never deleting it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError

RECORD = "made_by.json"
MANIFEST = "manifest.json"  # a checkpoint's (suite.train.checkpoint.MANIFEST; this module sits below train)
OVERWRITE = "--overwrite"  # the switch of every verb without train.overwrite in its config


# model sources from outside the suite (suite.model_source): an HF folder, a llama.cpp GGUF file
IMPORTED_PREFIXES = ("hf:", "gguf:")


def imported_path(text: str) -> Path | None:
    """The path of an `hf:<dir>` or `gguf:<file>` source (None for a suite run or checkpoint)."""
    for prefix in IMPORTED_PREFIXES:
        if text.startswith(prefix):
            return Path(text[len(prefix) :]).expanduser()
    return None


def source_identity(folder: Path, is_hf: bool) -> str:
    """A model source (suite.model_source.ModelSource's folder) as it is on disk: an HF folder (or a
    GGUF file) by its resolved path; a suite checkpoint by its resolved folder and its manifest's
    sha256 (another step, or the same path retrained, is another source)."""
    folder = Path(folder).resolve()
    if is_hf:
        return f"{'gguf' if folder.is_file() else 'hf'}:{folder}"
    digest = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()[:16]
    return f"{folder} (manifest sha256 {digest})"


def made_by(verb: str, source: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The record of a folder `verb` writes; plain JSON values, as read back."""
    return json.loads(json.dumps({"verb": verb, "source": source, "settings": settings}))


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def write_record(folder: Path, made: dict[str, Any]) -> None:
    """Written when the verb starts writing the folder (quantize, prune, report, run), so a
    half-written folder says what it was becoming (the same command continues it; another is
    refused); by export once it has succeeded (its refusals come late, after the folder's check)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(made, indent=1) + "\n")
    os.replace(tmp, folder / RECORD)


def _flat(made: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in made.items() if k != "settings"}
    out.update(made.get("settings") or {})
    return out


def _show(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: X there, Y now` for every key both records hold that differs (a record written before
    a key existed is not compared on it)."""
    old, new = _flat(then), _flat(now)
    if old.get("verb") is not None and old.get("verb") != new.get("verb"):
        return [f"written by suite {old['verb']}, not suite {new['verb']}"]
    return [
        f"{key}: {_show(value)} there, {_show(new[key])} now"
        for key, value in old.items()
        if key in new and new[key] != value
    ]


def check_claim(
    folder: Path,
    made: dict[str, Any],
    key: str,
    overwrite: bool,
    switch: str = OVERWRITE,
    legacy: Callable[[Path], dict[str, Any] | None] | None = None,
    reads: tuple[Path, ...] = (),
) -> bool:
    """`claim`'s answer without its move: False to go on into `folder` as it is (new, empty, or made
    by the same thing), True when `overwrite` will move its content aside; else ConfigError. Writes
    nothing, so a verb can check everything else before `claim` moves anything."""
    folder = Path(folder).expanduser()
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    then = read_record(folder)
    if then is None and legacy is not None:
        then = legacy(folder)
    if then is None:
        changed = [f"files not written by suite {made['verb']} (no {RECORD})"]
    else:
        changed = differences(then, made)
    if not changed:
        return False
    if overwrite:
        inside = [r for r in reads if folder.resolve() in (Path(r).resolve(), *Path(r).resolve().parents)]
        if inside:
            raise ConfigError(
                f"{key}={folder} holds {inside[0]}, which this command reads and {switch} would move aside "
                f"first; pass a new folder, e.g. {key}={new_folder(folder)}"
            )
        return True
    raise ConfigError(
        f"{key}={folder} holds something else ({'; '.join(changed)}); pass {key}={new_folder(folder)} (a "
        f"new folder) to keep it, or {switch} to move it aside ({folder}.old-N) and write this one"
    )


def claim(
    folder: Path,
    made: dict[str, Any],
    key: str,
    overwrite: bool,
    switch: str = OVERWRITE,
    legacy: Callable[[Path], dict[str, Any] | None] | None = None,
    reads: tuple[Path, ...] = (),
) -> Path | None:
    """Before `made`'s verb writes `folder` (named by the config key `key`): returns None to go on
    (new, empty, or made by the same thing), or the `.old-N` folder the old content was moved to
    (`overwrite`); else ConfigError, the folder untouched. `legacy(folder)`: what a folder written
    before records existed tells of its maker (None: not this verb's, refused). `reads`: what the
    command reads (its source), which the move aside must not carry away."""
    folder = Path(folder).expanduser()
    if not check_claim(folder, made, key, overwrite, switch, legacy, reads):
        return None
    moved = move_aside(folder, key, switch)
    print(f"{switch}: moved the previous content of {folder} to {moved}", flush=True)
    return moved


def new_folder(folder: Path) -> Path:
    """The folder a refusal suggests instead of `folder`: the first free `<folder>-<N>` beside it (N
    from 2), a value to type as printed, not a placeholder."""
    folder = Path(folder)
    n = 2
    while (other := folder.with_name(f"{folder.name}-{n}")).exists():
        n += 1
    return other


def _free(folder: Path) -> Path:
    """`folder` if nothing is there, else the first free `<folder>-<N>`."""
    return folder if not folder.exists() else new_folder(folder)


def move_aside(folder: Path, key: str = "run.dir", switch: str = "train.overwrite=true") -> Path:
    """Rename `folder` to the first free `<folder>.old-<N>` beside it; returns the new name. Never
    the current folder, one above it, or the home folder."""
    folder = Path(folder)
    here = Path.cwd().resolve()
    resolved = folder.resolve()
    if resolved == here or resolved in here.parents or resolved == Path.home().resolve():
        raise ConfigError(
            f"{key}={folder} is the current folder, one above it or the home folder; {switch} would move "
            f"it aside: give the output a folder of its own, e.g. {key}={_free(here / 'runs' / 'out')}"
        )
    n = 1
    while (target := folder.with_name(f"{folder.name}.old-{n}")).exists():
        n += 1
    os.replace(folder, target)
    return target
