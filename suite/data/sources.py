"""Read the documents of one `data.sources[i]` entry: local .txt/.jsonl/.parquet files or a `datasets` name."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError

SUPPORTED = (".txt", ".jsonl", ".parquet")
# A .txt file is cut at blank lines into documents of about this many characters, so one big file
# (a book, tinyshakespeare) still yields a train/val split and its paragraphs stay together.
TXT_DOC_CHARS = 16_000


def source_key(index: int) -> str:
    return f"data.sources[{index}]"


def source_fields(src: Any) -> dict[str, Any]:
    """A DataSourceConfig (dataclass or DictConfig) as a plain dict, for meta.json and cache keys."""
    return {
        "path": str(src.path),
        "weight": float(src.weight),
        "text_field": str(src.text_field),
        "split": str(src.split),
        "name": None if src.name is None else str(src.name),
    }


def read_source(src: Any, index: int) -> list[str]:
    """Every non-empty document of one source, in a fixed order."""
    key = source_key(index)
    fields = source_fields(src)
    if not fields["weight"] > 0:
        raise ConfigError(f"{key}.weight={src.weight} must be > 0; drop the source instead of weighting it 0")
    files = local_files(fields["path"], key)
    if files is None:
        return _read_datasets(fields, key)
    docs: list[str] = []
    for path in files:
        if path.suffix == ".txt":
            docs.extend(split_text(path.read_text(encoding="utf-8", errors="replace")))
        elif path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path, fields["text_field"], key))
        else:
            docs.extend(_read_parquet(path, fields["text_field"], key))
    return [d for d in docs if d.strip()]


def match_local(pattern: str, suffixes: tuple[str, ...]) -> list[Path] | None:
    """The sorted files a local path/glob/folder names (a folder: its files with `suffixes`), or
    None when `pattern` looks like a `datasets` name instead."""
    expanded = os.path.expanduser(pattern)
    magic = any(c in expanded for c in "*?[")
    looks_local = (
        magic
        or os.path.exists(expanded)
        or expanded.startswith(("/", "./", "../"))
        or Path(expanded).suffix in suffixes
    )
    if not looks_local:
        return None
    if os.path.isdir(expanded):
        return sorted(p for p in Path(expanded).rglob("*") if p.is_file() and p.suffix in suffixes)
    return sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))


def local_files(pattern: str, key: str) -> list[Path] | None:
    """The sorted files a local path/glob/folder names, or None when it looks like a `datasets` name."""
    matches = match_local(pattern, SUPPORTED)
    if matches is None:
        return None
    if not matches:
        raise ConfigError(
            f"{key}.path='{pattern}' matches no files; give a .txt/.jsonl/.parquet file, folder or glob "
            "(e.g. /data/*.txt), or a `datasets` name such as roneneldan/TinyStories"
        )
    for path in matches:
        if path.suffix not in SUPPORTED:
            raise ConfigError(
                f"{key}.path='{pattern}' matches '{path}', which is not {'/'.join(SUPPORTED)}; "
                "narrow the glob (e.g. *.txt) or convert the file"
            )
    return matches


def split_text(text: str, max_chars: int = TXT_DOC_CHARS) -> list[str]:
    """Greedily pack blank-line-separated blocks into documents of about `max_chars` characters."""
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for block in text.split("\n\n"):
        if current and size + len(block) > max_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
        current.append(block)
        size += len(block) + 2
    if current:
        docs.append("\n\n".join(current))
    return docs


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed record) for every non-blank line of a JSONL file; a line that
    is not valid JSON gives its json.JSONDecodeError as the record (each reader decides)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                yield lineno, err


def _read_jsonl(path: Path, field: str, key: str) -> list[str]:
    docs = []
    for lineno, record in json_lines(path):
        if isinstance(record, json.JSONDecodeError):
            raise ConfigError(
                f"{key}: '{path}' line {lineno} is not valid JSON ({record.msg}); fix or remove it"
            )
        if not isinstance(record, dict) or field not in record:
            raise ConfigError(
                f"{key}.text_field='{field}' is not a field of '{path}' line {lineno}; "
                f"set {key}.text_field to the key that holds the text"
            )
        docs.append(str(record[field]))
    return docs


def _read_parquet(path: Path, field: str, key: str) -> list[str]:
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    if field not in columns:
        raise ConfigError(
            f"{key}.text_field='{field}' is not a column of '{path}' (columns: {', '.join(columns)}); "
            f"set {key}.text_field to the text column"
        )
    return [str(t) for t in pq.read_table(path, columns=[field]).column(field).to_pylist() if t is not None]


def _read_datasets(fields: dict[str, Any], key: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(fields["path"], fields["name"], split=fields["split"])
    except Exception as err:  # network, missing dataset, bad split: all one user-facing line
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"{key}.path='{fields['path']}' is neither a local file nor a loadable `datasets` dataset "
            f"({reason}); check the name, {key}.name and {key}.split, or give a local path"
        ) from err
    if fields["text_field"] not in ds.column_names:
        raise ConfigError(
            f"{key}.text_field='{fields['text_field']}' is not a column of dataset '{fields['path']}' "
            f"(columns: {', '.join(ds.column_names)}); set {key}.text_field"
        )
    return [str(t) for t in ds[fields["text_field"]] if t is not None]
