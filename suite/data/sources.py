"""Read the documents of one `data.sources[i]` entry: local .txt/.jsonl(.gz)/.parquet files, a folder
`datasets` saved, or a `datasets` name. Files are opened through suite.user_files, so a file in another
encoding or format, binary junk or an empty source is one line naming the file."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from suite import user_files
from suite.config.errors import ConfigError

SUPPORTED = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
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
    if user_files.is_saved_dataset(fields["path"]):
        ds = user_files.load_saved_dataset(fields["path"], fields["split"], f"{key}.path")
        return _dataset_texts(ds, fields, key)
    files = local_files(fields["path"], key)
    if files is None:
        return _read_datasets(fields, key)
    docs: list[str] = []
    for path in files:
        if path.name.endswith(".txt"):
            docs.extend(split_text(user_files.read_text(path, key)))
        elif path.name.endswith(".parquet"):
            docs.extend(_read_parquet(path, fields["text_field"], key))
        else:
            docs.extend(_read_jsonl(path, fields["text_field"], key))
    docs = [d for d in docs if d.strip()]
    if not docs:
        where = f"'{files[0]}' is" if len(files) == 1 else f"its {len(files)} files ('{files[0]}', ...) are"
        raise ConfigError(
            f"{key}.path='{fields['path']}' holds no text: {where} empty or blank; fill it, or drop the source"
        )
    return docs


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


def _read_jsonl(path: Path, field: str, key: str) -> list[str]:
    docs = []
    for lineno, record in user_files.json_lines(path, key):
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
    columns = user_files.parquet_columns(path, key)
    if field not in columns:
        raise ConfigError(
            f"{key}.text_field='{field}' is not a column of '{path}' (columns: {', '.join(columns)}); "
            f"set {key}.text_field to the text column"
        )
    table = user_files.read_parquet(path, key, columns=[field])
    return [str(t) for t in table.column(field).to_pylist() if t is not None]


def _read_datasets(fields: dict[str, Any], key: str) -> list[str]:
    # deferred: datasets costs ~1-2 s to import; only a Hugging Face dataset source needs it
    import datasets

    try:
        ds = datasets.load_dataset(fields["path"], fields["name"], split=fields["split"])
    except Exception as err:  # network, missing dataset, bad split: all one user-facing line
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"{key}.path='{fields['path']}' is neither a local file nor a loadable `datasets` dataset "
            f"({reason}); check the name, {key}.name and {key}.split, or give a local path"
        ) from err
    return _dataset_texts(ds, fields, key)


def _dataset_texts(ds: Any, fields: dict[str, Any], key: str) -> list[str]:
    """The text column of a `datasets.Dataset` (downloaded or saved to disk)."""
    if fields["text_field"] not in ds.column_names:
        raise ConfigError(
            f"{key}.text_field='{fields['text_field']}' is not a column of dataset '{fields['path']}' "
            f"(columns: {', '.join(ds.column_names)}); set {key}.text_field"
        )
    return [str(t) for t in ds[fields["text_field"]] if t is not None]
