"""The files of one `data.sources[i]` entry (local .txt/.jsonl(.gz/.zst)/.parquet files, folders and
globs of them) and its fields; suite.data.streams reads them as a stream of work units."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError

SUPPORTED = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
# A .txt file is cut at blank lines into documents of about this many characters, so one big file
# (a book, tinyshakespeare) still yields a train/val split and its paragraphs stay together.
TXT_DOC_CHARS = 16_000


def source_key(index: int) -> str:
    return f"data.sources[{index}]"


def source_fields(src: Any) -> dict[str, Any]:
    """A DataSourceConfig (dataclass or DictConfig) as a plain dict, for meta.json and cache keys."""
    fields = {
        "path": str(src.path),
        "weight": float(src.weight),
        "text_field": str(src.text_field),
        "split": str(src.split),
        "name": None if src.name is None else str(src.name),
    }
    min_chars = int(getattr(src, "min_chars", 0) or 0)
    if min_chars:  # only when set, so the cache keys of sources without a filter stay what they were
        fields["min_chars"] = min_chars
    return fields


def match_local(pattern: str, suffixes: tuple[str, ...]) -> list[Path] | None:
    """The sorted files a local path/glob/folder names (a folder: its files with `suffixes`), or
    None when `pattern` looks like a `datasets` name instead."""
    expanded = os.path.expanduser(pattern)
    magic = any(c in expanded for c in "*?[")
    looks_local = (
        magic
        or os.path.exists(expanded)
        or expanded.startswith(("/", "./", "../"))
        or expanded.endswith(suffixes)
    )
    if not looks_local:
        return None
    if os.path.isdir(expanded):
        return sorted(p for p in Path(expanded).rglob("*") if p.is_file() and p.name.endswith(suffixes))
    return sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))


def local_files(pattern: str, key: str) -> list[Path] | None:
    """The sorted files a local path/glob/folder names, or None when it looks like a `datasets` name."""
    matches = match_local(pattern, SUPPORTED)
    if matches is None:
        return None
    if not matches:
        raise ConfigError(
            f"{key}.path='{pattern}' matches no files; give a {'/'.join(SUPPORTED)} file, folder or glob "
            "(e.g. /data/*.txt), a folder `datasets` saved (save_to_disk), or a `datasets` name such as "
            "roneneldan/TinyStories"
        )
    for path in matches:
        if not path.name.endswith(SUPPORTED):
            raise ConfigError(
                f"{key}.path='{pattern}' matches '{path}', which is not {'/'.join(SUPPORTED)}; "
                "narrow the glob (e.g. *.txt) or convert the file"
            )
    return matches


def split_text(text: str, max_chars: int = TXT_DOC_CHARS) -> list[str]:
    """Greedily pack blank-line-separated blocks into documents of about `max_chars` characters."""
    return list(pack_blocks(text.split("\n\n"), max_chars))


def pack_blocks(blocks: Iterable[str], max_chars: int = TXT_DOC_CHARS) -> Iterator[str]:
    """`split_text` over a stream of blocks: a .txt file is cut into documents as it is read."""
    current: list[str] = []
    size = 0
    for block in blocks:
        if current and size + len(block) > max_chars:
            yield "\n\n".join(current)
            current, size = [], 0
        current.append(block)
        size += len(block) + 2
    if current:
        yield "\n\n".join(current)
