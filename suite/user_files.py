"""The one reader of files users hand the suite: text, JSON lines (plain, .gz or .zst), JSON, Parquet and
YAML. Whatever is wrong with such a file (an encoding other than UTF-8, another format under the
name, binary junk, an empty file, a file that cannot be opened) ends in one ConfigError line that
names the file, the line or byte, and what would work, never in a decoder's or pyarrow's traceback.

Readers of data (suite prepare's sources, SFT rows) and of recipes (suite run's pipeline YAML) call
these functions; `what` is the config key or phrase that leads the message (e.g. "data.sources[0]").
Imports nothing of suite but suite.config's errors, so any layer may use it.
"""

from __future__ import annotations

import gzip
import io
import json
import shlex
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
import zstandard
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from suite.config.errors import ConfigError

SNIFF_BYTES = 8192  # how much of a file's start is looked at to tell text from binary
# bytes that start a file of a format people mistake for text or JSON lines: what it is, and the name
# it reads under (a copy with that suffix is suggested, runnable as printed) or what to do instead
MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"PAR1", "a Parquet file", ".parquet"),
    (b"\x1f\x8b", "gzip-compressed", ".jsonl.gz"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", ".jsonl.zst"),
    (b"PK\x03\x04", "a zip archive", "unzip it and give the files inside"),
    (b"ARROW1", "an Arrow file", "convert it to .parquet or .jsonl"),
    (b"\xff\xfe", "UTF-16 text", "utf-16"),
    (b"\xfe\xff", "UTF-16 text", "utf-16"),
    (b"%PDF", "a PDF document", "extract its text first (e.g. pdftotext)"),
)
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\v\x1b")  # control bytes that plain text may hold


def _named(what: str, path: Path) -> str:
    return f"{what}: '{path}'" if what else f"'{path}'"


def _os_error(what: str, path: Path, err: OSError) -> ConfigError:
    reason = err.strerror or type(err).__name__
    if Path(path).is_dir():
        return ConfigError(f"{_named(what, path)} is a folder, not a file; give the file inside it")
    return ConfigError(f"{_named(what, path)} cannot be read ({reason}); check the path and its permissions")


def read_bytes(path: str | Path, what: str = "") -> bytes:
    """The file's bytes; a missing, unreadable or folder path is one line."""
    path = Path(path)
    try:
        return path.read_bytes()
    except OSError as err:
        raise _os_error(what, path, err) from None


def renamed(path: Path, suffix: str) -> str:
    """The command that gives `path` the name its format is read by (a copy: the file stays), in
    backticks as every command a refusal suggests, and the copy to give in its place."""
    path = Path(path)
    stem = path.name.split(".", 1)[0] or path.name
    target = path.with_name(f"{stem}{suffix}")
    n = 2
    while target.exists():
        target, n = path.with_name(f"{stem}-{n}{suffix}"), n + 1
    command = f"cp {shlex.quote(str(path))} {shlex.quote(str(target))}"
    return f"copy it to that name with `{command}` and give {shlex.quote(str(target))} in its place"


def binary_reason(head: bytes, path: Path | None = None) -> str | None:
    """Why `head` (the first bytes of the file `path`) is not text, or None when it may be text; with
    `path`, the way on names it (the copy to make, the command to re-encode it)."""
    for magic, what, fix in MAGIC:
        if not head.startswith(magic):
            continue
        if fix == "utf-16":
            how = _utf8_fix(Path(path), b"", "utf-16") if path else "re-encode it as UTF-8 with iconv"
            return f"is {what}; {how}"
        if fix.startswith("."):
            how = renamed(Path(path), fix) if path else f"name it {fix}"
            return f"is {what}; {how}"
        return f"is {what}; {fix}"
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"holds binary data, not text (a NUL byte at byte {nul})"
    controls = sum(1 for b in head if b < 0x20 and b not in _TEXT_CONTROLS)
    if head and controls > len(head) // 20:
        return f"holds binary data, not text ({controls} control bytes in its first {len(head)})"
    return None


def with_advice(why: str, advice: str) -> str:
    """`why` (binary_reason's answer), with `advice` when it gives none of its own."""
    return why if "; " in why else f"{why}; {advice}"


def _utf8_fix(path: Path, sample: bytes, source: str = "latin1") -> str:
    """The iconv command that re-encodes `path` (`source`; for Latin-1, cp1252 where its bytes say
    Windows), in backticks as every command a refusal suggests: runnable as printed
    (tests/suggested_fix.py)."""
    if source == "latin1" and any(0x80 <= b <= 0x9F for b in sample):
        try:
            sample.decode("cp1252")
            source = "cp1252"
        except UnicodeDecodeError:
            pass
    suffixes = ".jsonl.gz" if path.name.endswith(".jsonl.gz") else path.suffix
    stem = path.name[: -len(suffixes)] if suffixes else path.name
    name, target = shlex.quote(str(path)), shlex.quote(str(path.with_name(f"{stem}.utf8{suffixes}")))
    if path.name.endswith(".gz"):
        command = f"zcat {name} | iconv -f {source} -t utf-8 | gzip > {target}"
    else:
        command = f"iconv -f {source} -t utf-8 {name} > {target}"
    return f"re-encode it as UTF-8 with `{command}` and give {target} in its place"


def not_utf8(
    what: str, path: Path, err: UnicodeDecodeError, offset: int = 0, line: int | None = None
) -> ConfigError:
    """The one line for bytes that are not UTF-8: where (line, byte offset in the file), the byte, the fix.
    `offset`: where err.object starts in the file; `line`: its 1-based line number when known."""
    data = err.object if isinstance(err.object, bytes) else b""
    where = offset + err.start
    if line is None:
        line = data[: err.start].count(b"\n") + 1
    byte = data[err.start : err.start + 1].hex() or "?"
    return ConfigError(
        f"{_named(what, path)} is not UTF-8 text (line {line}, byte {where}: 0x{byte}); {_utf8_fix(path, data)}"
    )


def read_text(path: str | Path, what: str = "") -> str:
    """A UTF-8 text file's contents; binary junk, another format or another encoding is one line."""
    path = Path(path)
    data = read_bytes(path, what)
    why = binary_reason(data[:SNIFF_BYTES], path)
    if why:
        raise ConfigError(f"{_named(what, path)} {with_advice(why, 'give UTF-8 text')}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise not_utf8(what, path, err) from None


def _decompressor(path: Path, raw: Any) -> Any:
    """A buffered (peekable) reader of `raw`'s decompressed bytes, by the file's name."""
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.name.endswith(".zst"):
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def open_lines(path: str | Path, what: str = "") -> tuple[Any, Any]:
    """(the file on disk, a binary handle on its JSON lines): .gz/.zst decompressed as read, the start
    checked for another format. `file.tell()` is how far into the file on disk reading has come."""
    path = Path(path)
    kind = "zstd" if path.name.endswith(".zst") else "gzip"
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed with the handle, or below
    except OSError as err:
        raise _os_error(what, path, err) from None
    try:
        handle = _decompressor(path, raw)
        head = handle.peek(SNIFF_BYTES)[:SNIFF_BYTES]
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as err:
        raw.close()
        raise ConfigError(
            f"{_named(what, path)} is not a readable {kind} file ({err}); if it is plain JSON lines, "
            f"{renamed(path, '.jsonl')}"
        ) from None
    why = binary_reason(head, path)
    if why:
        handle.close()
        raw.close()
        raise ConfigError(
            f"{_named(what, path)} {with_advice(why, 'JSON lines are UTF-8 text, one object a line')}"
        )
    return raw, handle


def _open_lines(path: Path, what: str) -> Any:
    return open_lines(path, what)[1]


def read_block(handle: Any, size: int, path: Path, what: str, line: int) -> bytes:
    """Up to `size` bytes of a JSON lines handle; a broken compressed stream is one line."""
    try:
        return handle.read(size)
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as err:
        raise ConfigError(
            f"{_named(what, path)} is cut short or corrupt after line {line} ({err}); copy or download it again"
        ) from None


def json_lines(path: str | Path, what: str = "") -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed record) for every non-blank line of a JSON lines file (.jsonl, or
    .jsonl.gz); a line that is not valid JSON gives its json.JSONDecodeError as the record (each
    reader decides). Bytes that are not UTF-8, a broken .gz or a binary file are one ConfigError."""
    path = Path(path)
    offset = 0
    with _open_lines(path, what) as handle:
        lineno = 0
        while True:
            try:
                raw = handle.readline()
            except (OSError, EOFError, zlib.error, zstandard.ZstdError) as err:
                raise ConfigError(
                    f"{_named(what, path)} is cut short or corrupt after line {lineno} ({err}); "
                    "copy or download it again"
                ) from None
            if not raw:
                return
            lineno += 1
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is no JSON
            except UnicodeDecodeError as err:
                raise not_utf8(what, path, err, offset, lineno) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                yield lineno, err


def read_json(path: str | Path, what: str = "") -> Any:
    """A whole-file JSON document; invalid JSON names the line and column."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{_named(what, path)} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
            "fix it there, or use .jsonl with one row a line"
        ) from None


def _not_parquet(what: str, path: Path, err: Exception) -> ConfigError:
    """A .parquet file pyarrow cannot read: what it looks like instead, and what to do."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    except OSError as os_err:
        return _os_error(what, path, os_err)
    reason = (str(err).splitlines() or [type(err).__name__])[0]
    if not head:
        return ConfigError(
            f"{_named(what, path)} is empty (0 bytes); write the Parquet file again or drop it"
        )
    if not head.startswith(b"PAR1"):
        stripped = head.lstrip()
        if stripped.startswith((b"{", b"[")):
            hint = f"it looks like JSON, read as .jsonl (one object a line): {renamed(path, '.jsonl')}"
        elif binary_reason(head) is None:
            hint = f"it looks like text, read as .txt: {renamed(path, '.txt')}"
        else:
            hint = "convert it to Parquet (e.g. pandas: df.to_parquet(path))"
        return ConfigError(f"{_named(what, path)} is not a Parquet file (no Parquet header); {hint}")
    return ConfigError(
        f"{_named(what, path)} is not a readable Parquet file ({reason}); it may be cut short: write it again"
    )


def parquet_columns(path: str | Path, what: str = "") -> list[str]:
    """The column names of a Parquet file; a file that is not Parquet is one line."""
    # deferred: pyarrow.parquet (~0.2 s) stays out of suite --help, which imports this module
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        return list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError) as err:
        raise _not_parquet(what, path, err) from None


def read_parquet(path: str | Path, what: str = "", columns: list[str] | None = None) -> Any:
    """A Parquet file as a pyarrow Table (only `columns` when given); a file that is not Parquet is one line."""
    # deferred: pyarrow.parquet (~0.2 s) stays out of suite --help, which imports this module
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as err:
        raise _not_parquet(what, path, err) from None


def parquet_batches(
    path: str | Path, column: str, what: str = "", rows: int = 1024
) -> Iterator[tuple[list, int]]:
    """(values of `column`, rows in the file) for each batch of up to `rows` rows of a Parquet file,
    read a record batch at a time; a file that is not Parquet, or breaks while read, is one line."""
    # deferred: pyarrow.parquet (~0.2 s) stays out of suite --help, which imports this module
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        file = pq.ParquetFile(path)
        total = file.metadata.num_rows
        for batch in file.iter_batches(batch_size=rows, columns=[column]):
            yield batch.column(0).to_pylist(), total
    except (pa.ArrowException, OSError) as err:
        raise _not_parquet(what, path, err) from None


def read_yaml(path: str | Path, what: str = "") -> Any:
    """A YAML file as plain data (interpolations left as written); a syntax error is one line,
    `file:line:column: problem`."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = err.problem or err.context or "invalid YAML"
        context = ""
        if err.context and err.problem:
            start = err.context_mark
            context = f" ({err.context} that starts at {start.line + 1}:{start.column + 1})" if start else ""
            context = context or f" ({err.context})"
        lead = f"{what}: " if what else ""
        raise ConfigError(f"{lead}{at}: {problem}{context}; fix the YAML there") from None
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{_named(what, path)} does not parse as YAML ({reason})") from None


def is_saved_dataset(path: str | Path) -> bool:
    """Whether `path` is a folder `datasets`' save_to_disk wrote (a Dataset or a DatasetDict)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and any((folder / n).is_file() for n in ("state.json", "dataset_dict.json"))


def load_saved_dataset(path: str | Path, split: str, what: str = "") -> Any:
    """One split of a save_to_disk folder as a `datasets.Dataset` (a single Dataset is its own split);
    a broken folder or an absent split is one line."""
    # deferred: datasets costs ~1-2 s to import; only a Hugging Face dataset source needs it
    import datasets

    folder = Path(path).expanduser()
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as err:  # noqa: BLE001 (missing shards, bad JSON, a foreign version: one line)
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"{_named(what, folder)} is a `datasets` folder that does not load ({reason}); save it again "
            "with Dataset.save_to_disk, or give .jsonl/.parquet files"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"{_named(what, folder)} has no split '{split}' (splits: {', '.join(loaded)}); set its split"
            )
        return loaded[split]
    return loaded
