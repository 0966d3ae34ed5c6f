"""Where text lives, as a stream of small work units: `suite prepare` never holds a whole source.

The parent reads each source in order and cuts it into units of about `batch_bytes` of text: raw
JSON lines (.jsonl, .jsonl.gz, .jsonl.zst; decompressed as they are read), lists of documents from
.txt files, Parquet record batches and `datasets` rows (a save_to_disk folder, or a name streamed
with `streaming=True`). A unit depends only on the bytes read and `batch_bytes`, never on timing or
on how many workers there are, so the documents come out in one fixed order. Workers turn a unit
into texts (`unit_texts`: JSON parsing, the dotted `text_field`, the per-source length filter), so
the parent's share of the work stays small.

A file that cannot be read ends in one ConfigError line naming it (suite.user_files), or, with
`data.skip_bad_files=true`, is skipped and counted (`Reading.bad_files`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from suite import user_files
from suite.config.errors import ConfigError
from suite.data.sources import local_files, pack_blocks, source_fields, source_key

DATASET_ROWS = 1024  # rows of a `datasets` source read at a time


@dataclass(frozen=True)
class Unit:
    """One piece of one source: raw JSON lines (`lines`) or ready documents (`texts`)."""

    source: int
    where: str  # the file (or dataset) it came from, for messages
    text_field: str
    min_chars: int
    skip_bad: bool
    lines: bytes = b""
    texts: tuple[str, ...] = ()
    first_line: int = 1  # 1-based line number of `lines`' first line in the file
    offset: int = 0  # byte offset of `lines` in the (decompressed) file


@dataclass
class Reading:
    """What the parent saw while reading: bytes read (for the progress bar) and files skipped."""

    bytes_read: int = 0
    bad_files: list[str] = field(default_factory=list)
    on_bytes: Callable[[int], None] | None = None

    def advance(self, n: int) -> None:
        self.bytes_read += n
        if self.on_bytes is not None:
            self.on_bytes(n)


def get_field(record: Any, dotted: str) -> Any:
    """record[dotted], or the nested value a dotted path names (`meta.body` -> record['meta']['body']);
    None when absent. A key that itself holds dots wins over the path."""
    if isinstance(record, dict) and dotted in record:
        return record[dotted]
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def keep(text: Any, min_chars: int) -> bool:
    """Whether a document passes the filters: text, not blank, at least `min_chars` characters."""
    return isinstance(text, str) and bool(text.strip()) and len(text) >= min_chars


def unit_texts(unit: Unit) -> tuple[list[str], int, int]:
    """(kept documents, filtered count, bad records) of a unit; runs in the tokenization workers."""
    if not unit.lines:
        texts = [t for t in unit.texts if keep(t, unit.min_chars)]
        return texts, len(unit.texts) - len(texts), 0
    key = source_key(unit.source)
    path = Path(unit.where)
    texts: list[str] = []
    filtered = bad = 0
    offset = unit.offset
    for number, raw in enumerate(unit.lines.splitlines(keepends=True), start=unit.first_line):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if start == 0 else "utf-8")
            record = json.loads(line)
        except UnicodeDecodeError as err:
            if unit.skip_bad:
                bad += 1
                continue
            raise user_files.not_utf8(key, path, err, start, number) from None
        except json.JSONDecodeError as err:
            if unit.skip_bad:
                bad += 1
                continue
            raise ConfigError(
                f"{key}: '{path}' line {number} is not valid JSON ({err.msg}); fix or remove it, "
                "or set data.skip_bad_files=true to skip such lines"
            ) from None
        text = get_field(record, unit.text_field)
        if text is None and not (isinstance(record, dict) and _has_path(record, unit.text_field)):
            raise ConfigError(
                f"{key}.text_field='{unit.text_field}' is not a field of '{path}' line {number}; "
                f"set {key}.text_field to the key that holds the text (a dotted path reaches nested keys)"
            )
        if text is not None and not isinstance(text, str):
            text = str(text)
        if keep(text, unit.min_chars):
            texts.append(text)
        else:
            filtered += 1
    return texts, filtered, bad


def _has_path(record: dict, dotted: str) -> bool:
    """Whether the field exists (holding null counts as present: that row is filtered, not an error)."""
    if dotted in record:
        return True
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def known_size(sources: list[Any]) -> int | None:
    """Bytes on disk of every local source file (None when a source is a `datasets` name or folder):
    the progress bar's total, so it can show an ETA."""
    total = 0
    for index, src in enumerate(sources):
        path = str(src.path)
        if user_files.is_saved_dataset(path):
            return None
        files = local_files(path, source_key(index))
        if files is None:
            return None
        total += sum(p.stat().st_size for p in files)
    return total


def source_units(src: Any, index: int, batch_bytes: int, skip_bad: bool, reading: Reading) -> Iterator[Unit]:
    """The units of one `data.sources[index]`, in a fixed order."""
    key = source_key(index)
    fields = source_fields(src)
    if not fields["weight"] > 0:
        raise ConfigError(f"{key}.weight={src.weight} must be > 0; drop the source instead of weighting it 0")
    base = {"source": index, "text_field": fields["text_field"], "min_chars": int(fields.get("min_chars", 0))}
    base["skip_bad"] = skip_bad
    if user_files.is_saved_dataset(fields["path"]):
        ds = user_files.load_saved_dataset(fields["path"], fields["split"], f"{key}.path")
        yield from _dataset_units(ds, fields, base, batch_bytes, reading)
        return
    files = local_files(fields["path"], key)
    if files is None:
        yield from _dataset_units(_load_streaming(fields, key), fields, base, batch_bytes, reading)
        return
    for path in files:
        try:
            if path.name.endswith(".txt"):
                docs = pack_blocks(_txt_blocks(path, key, reading, batch_bytes))
                yield from _text_units(docs, str(path), base, batch_bytes)
            elif path.name.endswith(".parquet"):
                yield from _parquet_units(path, fields, base, batch_bytes, reading, key)
            else:
                yield from _line_units(path, base, batch_bytes, reading, key)
        except ConfigError:
            if not skip_bad or _is_field_error(fields, path, key):
                raise
            reading.bad_files.append(str(path))


def _is_field_error(fields: dict[str, Any], path: Path, key: str) -> bool:
    """A missing text column is the config's mistake, not a bad file: never skipped."""
    if not path.name.endswith(".parquet"):
        return False
    try:
        columns = user_files.parquet_columns(path, key)
    except ConfigError:
        return False
    return fields["text_field"].split(".")[0] not in columns and fields["text_field"] not in columns


def _text_units(texts: Iterable[Any], where: str, base: dict[str, Any], batch_bytes: int) -> Iterator[Unit]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text) if isinstance(text, str) else 0
        if size >= batch_bytes:
            yield Unit(where=where, texts=tuple(batch), **base)
            batch, size = [], 0
    if batch:
        yield Unit(where=where, texts=tuple(batch), **base)


def _txt_blocks(path: Path, key: str, reading: Reading, block_bytes: int) -> Iterator[str]:
    """The blank-line-separated blocks of a UTF-8 .txt file (`text.split("\\n\\n")` of the whole
    file), read `block_bytes` at a time: a big file is never held whole."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below; the open's error is one line)
    except OSError as err:
        raise user_files._os_error(key, path, err) from None
    with handle:
        pending, offset, lines = b"", 0, 0  # undecoded bytes, their offset and line in the file
        held: list[str] = []  # text since the last blank line
        while True:
            data = handle.read(block_bytes)
            if not offset and not pending:
                why = user_files.binary_reason(data[: user_files.SNIFF_BYTES], Path(path))
                if why:
                    raise ConfigError(f"{key}: '{path}' {user_files.with_advice(why, 'give UTF-8 text')}")
            reading.advance(len(data))
            pending += data
            cut = pending.rfind(b"\n") + 1 if data else len(pending)  # never inside a character
            if data and not cut:
                continue
            piece, pending = pending[:cut], pending[cut:]
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError as err:
                line = lines + piece[: err.start].count(b"\n") + 1
                raise user_files.not_utf8(key, path, err, offset, line) from None
            offset, lines = offset + len(piece), lines + piece.count(b"\n")
            last = held[-1][-1:] if held else ""
            if "\n\n" in text or (last == "\n" and text.startswith("\n")) or not data:
                blocks = ("".join(held) + text).split("\n\n")
                held = [blocks.pop()] if data else []
                yield from blocks
            else:
                held.append(text)
            if not data:
                return


def _line_units(
    path: Path, base: dict[str, Any], batch_bytes: int, reading: Reading, key: str
) -> Iterator[Unit]:
    """Whole lines of a (compressed) JSON lines file, about batch_bytes at a time."""
    raw_file, handle = user_files.open_lines(path, key)
    with handle:
        rest = b""
        line, offset, consumed = 1, 0, 0
        while True:
            block = user_files.read_block(handle, batch_bytes, path, key, line)
            position = raw_file.tell() if raw_file is not None else consumed + len(block)
            reading.advance(position - consumed)
            consumed = position
            data = rest + block
            cut = len(data) if not block else data.rfind(b"\n") + 1
            if cut > 0:
                chunk, rest = data[:cut], data[cut:]
                yield Unit(where=str(path), lines=chunk, first_line=line, offset=offset, **base)
                line += chunk.count(b"\n")
                offset += len(chunk)
            else:
                rest = data
            if not block:
                return


def _text_column(fields: dict[str, Any], columns: list[str], where: str, key: str) -> str:
    """The top-level column that holds `text_field` (itself, or the first part of a dotted path)."""
    name = fields["text_field"]
    if name in columns:
        return name
    top = name.split(".")[0]
    if "." in name and top in columns:
        return top
    raise ConfigError(
        f"{key}.text_field='{name}' is not a column of {where} (columns: {', '.join(columns)}); "
        f"set {key}.text_field to the text column (a dotted path reaches into a struct column)"
    )


def _values(rows: list[Any], column: str, dotted: str) -> list[Any]:
    if column == dotted:
        return rows
    rest = dotted[len(column) + 1 :]
    return [get_field(r, rest) if isinstance(r, dict) else None for r in rows]


def _parquet_units(
    path: Path, fields: dict[str, Any], base: dict[str, Any], batch_bytes: int, reading: Reading, key: str
) -> Iterator[Unit]:
    column = _text_column(fields, user_files.parquet_columns(path, key), f"'{path}'", key)
    size, done = path.stat().st_size, 0
    for rows, file_rows in user_files.parquet_batches(path, column, key):
        share = size * len(rows) // max(file_rows, 1)
        reading.advance(share)
        done += share
        texts = [
            t if t is None or isinstance(t, str) else str(t)
            for t in _values(rows, column, fields["text_field"])
        ]
        yield from _text_units(texts, str(path), base, batch_bytes)
    reading.advance(size - done)


def _load_streaming(fields: dict[str, Any], key: str) -> Any:
    """A `datasets` name, streamed (`streaming=True`): rows arrive as they download."""
    # deferred: datasets costs ~1-2 s to import; only a Hugging Face dataset source needs it
    import datasets

    try:
        return datasets.load_dataset(fields["path"], fields["name"], split=fields["split"], streaming=True)
    except Exception as err:  # network, missing dataset, bad split: all one user-facing line
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"{key}.path='{fields['path']}' is neither a local file nor a loadable `datasets` dataset "
            f"({reason}); check the name, {key}.name and {key}.split, or give a local path"
        ) from err


def _dataset_units(
    ds: Any, fields: dict[str, Any], base: dict[str, Any], batch_bytes: int, reading: Reading
) -> Iterator[Unit]:
    """Rows of a `datasets.Dataset` (saved to disk) or `IterableDataset` (streamed), in batches."""
    key = source_key(base["source"])
    names = getattr(ds, "column_names", None)
    if names:  # a streamed dataset may not know its columns before the first row
        column = _text_column(fields, list(names), f"dataset '{fields['path']}'", key)
        ds = ds.select_columns([column])
    else:
        column = fields["text_field"].split(".")[0]
    for rows in ds.iter(batch_size=DATASET_ROWS):
        if column not in rows:
            raise ConfigError(
                f"{key}.text_field='{fields['text_field']}' is not a column of dataset '{fields['path']}' "
                f"(columns: {', '.join(rows)}); set {key}.text_field"
            )
        texts = [
            t if t is None or isinstance(t, str) else str(t)
            for t in _values(rows[column], column, fields["text_field"])
        ]
        reading.advance(sum(len(t) for t in texts if t))
        yield from _text_units(texts, fields["path"], base, batch_bytes)


def no_text(src: Any, index: int) -> ConfigError:
    """The one line for a source that yields no document at all."""
    key, path = source_key(index), str(src.path)
    files = None if user_files.is_saved_dataset(path) else local_files(path, key)
    where = "it is"
    if files:
        where = f"'{files[0]}' is" if len(files) == 1 else f"its {len(files)} files ('{files[0]}', ...) are"
    return ConfigError(
        f"{key}.path='{path}' holds no text: {where} empty or blank; fill it, or drop the source"
    )


def read_source(src: Any, index: int) -> list[str]:
    """Every kept document of one source, in order, in memory: for small sources and tests (suite
    prepare streams them instead)."""
    docs: list[str] = []
    for unit in source_units(src, index, 1 << 20, False, Reading()):
        docs.extend(unit_texts(unit)[0])
    if not docs:
        raise no_text(src, index)
    return docs
