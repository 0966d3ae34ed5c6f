"""`suite prepare`: text sources -> tokenizer + train/val token shards + meta.json, atomically.

Documents stream from the sources (suite.data.streams) through tokenization worker processes
(suite.data.workers) into resumable parts, then into the shards (suite.data.parts): memory does not
grow with the corpus. The output folder appears only when complete (built in a sibling work folder,
then renamed), so a crash or Ctrl-C never leaves a half-prepared folder that training would trust,
and a rerun of the same configuration continues from the last complete part.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from rich.console import Console

from suite import folders, user_files
from suite.config.errors import ConfigError
from suite.config.schema import DataConfig
from suite.data.corpus import build_embedded_corpus
from suite.data.parts import (
    DOCS,
    DUPLICATES,
    assemble,
    check_documents,
    complete_parts,
    sample_pass,
    split_documents,
    tokenize_parts,
    training_order,
)
from suite.data.prepare_report import PrepareProgress, describe_sources, print_report
from suite.data.shards import IndexedTokens, dtype_for
from suite.data.sources import local_files, source_fields
from suite.data.streams import Reading, Unit, known_size, no_text, source_units
from suite.data.tokenizer import load_tokenizer, train_tokenizer
from suite.data.workers import Pool, available_cores, refuse_unguarded_main
from suite.output_paths import check_replaceable

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent first runs just both build
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
CHECKED_FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json")
BATCH_MB = 1.0  # text per work unit sent to a tokenization worker
SAMPLE = "sample"  # the tokenizer-sample pass's records (suite.data.parts.sample_pass): a rerun replays them
TOKENIZER_DONE = ".tokenizer-done"  # written after the trained tokenizer is saved: a rerun reuses it
LOCK_FILE = ".lock"  # held while a prepare works in the folder: a second one of the same config waits
# what to do when the place a prepared folder goes cannot be written
WRITABLE_FIX = {
    "data.path": "give a folder you can write, e.g. data.path={folder}",
    "data.cache_dir": "give a cache folder you can write, e.g. data.cache_dir={folder}",
}


def prepare(
    cfg: Any, out_dir: Path, progress: bool = True, summary: bool = True, key: str = "data.path"
) -> Path:
    """Prepare `cfg.sources` (or the embedded corpus when empty) into `out_dir`; return `out_dir`.
    `summary`: end with the one-screen report (with `progress`); `suite prepare` prints its own line.
    `key`: the setting that named `out_dir`, for the one-line refusal of a place that cannot be written.

    Work happens in `.<name>.partial-<key>` beside `out_dir` (the key: the config and the sources' sizes
    and times), renamed into place when complete; a killed run, run again, continues there."""
    refuse_unguarded_main()  # first: a worker re-running the caller's script must not wait on the lock
    out_dir = Path(out_dir).expanduser()
    _check_config(cfg)
    _check_target(out_dir)
    check_replaceable(key, str(out_dir), WRITABLE_FIX.get(key, WRITABLE_FIX["data.path"]))
    console = Console(stderr=True, quiet=not progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sources, sources_meta = _sources(cfg, console)
    work = _work_folder(cfg, out_dir, sources)
    work.mkdir(exist_ok=True)
    work.chmod(0o755)  # a shared cache stays readable by other users
    try:
        meta = _build(cfg, work, sources, sources_meta, console, progress)
    except ConfigError:  # the input or config is wrong: a fixed rerun has another key anyway
        shutil.rmtree(work, ignore_errors=True)
        raise
    folders.write_record(work, made_record(cfg, sources))
    _install(work, out_dir, key)
    if summary:
        print_report(console, out_dir, meta, time.monotonic() - started)
    return out_dir


def _build(
    cfg: Any,
    work: Path,
    sources: list[Any],
    sources_meta: list[dict[str, Any]],
    console: Console,
    progress: bool,
) -> dict[str, Any]:
    """Everything up to the rename: tokenizer, parts, shards and meta.json in `work`; returns meta."""
    with _file_lock(work / LOCK_FILE):
        if (work / META_FILE).is_file():  # killed after the end of the work, before the rename
            return _finish(work)
        workers = int(cfg.workers or available_cores())
        size = known_size(sources)
        batch = _batch_bytes(cfg)
        if size is not None and size <= batch:
            workers = 1  # one unit of text: starting processes would cost more than it saves
        reading = Reading()
        units = partial(_units, sources, batch, bool(cfg.skip_bad_files), reading)
        with (
            PrepareProgress(console, size, progress and not console.quiet, reading) as bar,
            Pool(workers) as pool,
        ):
            paths = [str(src.path) for src in sources]
            tokenizer = _tokenizer(cfg, units, pool, paths, work, console, bar)
            bad_files = list(reading.bad_files)
            reading.bad_files.clear()
            done = complete_parts(work / "parts")
            if done:
                console.print(f"resuming: {done} part(s) already tokenized in {work}")
            bar.start("tokenizing")
            encoding = (str(work / "tokenizer.json"), tokenizer.eos_token_id, dtype_for(len(tokenizer)).str)
            totals, num_parts = tokenize_parts(
                units(),
                pool,
                work / "parts",
                _units_per_part(cfg),
                len(tokenizer),
                len(sources),
                bar.tick,
                encoding,
            )
            bad_files = sorted(set(bad_files) | set(reading.bad_files))
        _check_text(cfg, sources, totals.counts)
        vocab = len(tokenizer)
        chunk = int(float(cfg.part_mb) * 1_000_000)
        args = (float(cfg.val_fraction), len(sources), chunk)
        counts = assemble(work / "parts", num_parts, work, vocab, *args)
        mixture = describe_sources(sources_meta, totals.counts, counts["train"]["ranges"])
        meta = {
            "format_version": FORMAT_VERSION,
            "vocab_size": vocab,
            "eos_id": tokenizer.eos_token_id,
            "pad_id": tokenizer.pad_token_id,
            "num_train_tokens": counts["train"]["tokens"],
            "num_val_tokens": counts["val"]["tokens"],
            "num_train_docs": counts["train"]["docs"],
            "num_val_docs": counts["val"]["docs"],
            "val_fraction": float(cfg.val_fraction),
            "tokenizer": str(cfg.tokenizer) if cfg.tokenizer else "trained",
            "sources": mixture,
            "skipped_files": bad_files,
            # sizes + sha256 of the files training reads, checked by verify_prepared() on every open
            "files": {name: _file_record(work / name) for name in CHECKED_FILES if (work / name).is_file()},
        }
        if len(sources) > 1:  # the loader draws each source's windows from its range, by weight
            meta["train_ranges"] = counts["train"]["ranges"]
        tmp = work / f".{META_FILE}.tmp"
        tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, work / META_FILE)
        return _finish(work)


def _finish(work: Path) -> dict[str, Any]:
    """Drop the work's leftovers (meta.json, written last, says the folder is complete); its meta."""
    shutil.rmtree(work / "parts", ignore_errors=True)
    for name in (TOKENIZER_DONE, LOCK_FILE):
        (work / name).unlink(missing_ok=True)
    return json.loads((work / META_FILE).read_text(encoding="utf-8"))


def _check_text(cfg: Any, sources: list[Any], counts: np.ndarray) -> None:
    """A source that yielded no document is named (unless unreadable files are being skipped)."""
    for index, row in enumerate(counts):
        if not row[DOCS] + row[DUPLICATES] and not cfg.skip_bad_files:
            raise no_text(sources[index], index)


def _check_config(cfg: Any) -> None:
    if not 0.0 <= float(cfg.val_fraction) < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1); e.g. 0.02")
    if not cfg.sources and not float(cfg.max_corpus_mb) > 0:
        raise ConfigError(f"data.max_corpus_mb={cfg.max_corpus_mb} must be > 0; e.g. 8")
    if cfg.workers is not None and int(cfg.workers) < 1:
        raise ConfigError(f"data.workers={cfg.workers} must be >= 1 (or null: the cores available)")
    for name in ("part_mb", "tokenizer_sample_mb"):
        if not float(getattr(cfg, name)) > 0:
            raise ConfigError(f"data.{name}={getattr(cfg, name)} must be > 0; e.g. 64")
    for index, src in enumerate(cfg.sources):
        if int(src.min_chars) < 0:
            raise ConfigError(f"data.sources[{index}].min_chars={src.min_chars} must be >= 0")


def _check_target(out_dir: Path) -> None:
    """Refuse to replace a folder that holds something other than prepared data."""
    if out_dir.exists() and not is_prepared(out_dir) and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(
            f"data.path='{out_dir}' already exists and is not a prepared data folder; pass "
            f"data.path={folders.new_folder(out_dir)} (a new folder) so nothing of yours is overwritten"
        )


def _sources(cfg: Any, console: Console) -> tuple[list[Any], list[dict[str, Any]]]:
    """The sources to read (the embedded corpus as a JSON lines source when none are given), and
    their meta.json records."""
    if cfg.sources:
        return list(cfg.sources), [source_fields(s) for s in cfg.sources]
    corpus_dir = cache_root(cfg) / f"embedded-corpus-{corpus_hash(float(cfg.max_corpus_mb))}"
    console.print(f"building the embedded corpus (Python docstrings, {cfg.max_corpus_mb} MB) in {corpus_dir}")
    corpus = build_embedded_corpus(corpus_dir, float(cfg.max_corpus_mb))
    source = SimpleNamespace(
        path=str(corpus), weight=1.0, text_field="text", split="train", name=None, min_chars=0
    )
    return [source], [{"path": "embedded:python-docstrings", "weight": 1.0, "corpus": str(corpus)}]


def _units(sources: list[Any], batch: int, skip_bad: bool, reading: Reading) -> Iterator[Unit]:
    """One pass over every source's units, in order (reading from the start again each call)."""
    reading.bytes_read = 0
    for index, src in enumerate(sources):
        yield from source_units(src, index, batch, skip_bad, reading)


def _batch_bytes(cfg: Any) -> int:
    """Text per work unit: 1 MB, or less when parts are smaller (a part is whole units)."""
    return max(1, int(min(BATCH_MB, float(cfg.part_mb)) * 1_000_000))


def _units_per_part(cfg: Any) -> int:
    return max(1, round(float(cfg.part_mb) * 1_000_000 / _batch_bytes(cfg)))


def _work_folder(cfg: Any, out_dir: Path, sources: list[Any]) -> Path:
    """Where this configuration's prepare works: the same folder for the same config and the same
    source files (size, time), so a rerun resumes; other configs' leftovers are removed."""
    key = {
        "format": FORMAT_VERSION,
        "sources": [source_fields(s) for s in sources],
        "files": _source_files(sources),
        "vocab": int(cfg.vocab_size),
        "tokenizer": cfg.tokenizer
        and [str(cfg.tokenizer), Path(cfg.tokenizer).expanduser().stat().st_mtime_ns],
        "val_fraction": float(cfg.val_fraction),
        "part_mb": float(cfg.part_mb),
        "sample_mb": float(cfg.tokenizer_sample_mb),
        "skip_bad_files": bool(cfg.skip_bad_files),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    work = out_dir.with_name(f".{out_dir.name}.partial-{digest}")
    for stale in itertools.chain(
        out_dir.parent.glob(f".{out_dir.name}.partial-*"), out_dir.parent.glob(f".{out_dir.name}.tmp-*")
    ):
        if stale.is_dir() and stale != work:
            shutil.rmtree(stale, ignore_errors=True)
    return work


def _source_files(sources: list[Any]) -> list[list[Any]]:
    """Every file the sources name, with its size and modification time: another file, or the same
    file rewritten, is other input."""
    files = []
    for index, src in enumerate(sources):
        found = (
            None
            if user_files.is_saved_dataset(str(src.path))
            else local_files(str(src.path), f"data.sources[{index}]")
        )
        for path in found or [Path(str(src.path))]:
            stat = path.stat() if path.exists() else None
            files.append([str(path), stat.st_size if stat else None, stat.st_mtime_ns if stat else None])
    return files


def made_record(cfg: Any, sources: list[Any]) -> dict[str, Any]:
    """What defines a prepared folder (suite.folders' record, `made_by.json`): the sources as given,
    their files as found on disk (by size and time), the tokenizer and the split."""
    files = _source_files(sources)
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:12]
    trained = not cfg.tokenizer
    settings = {
        "data.sources": [source_fields(s) for s in cfg.sources]
        or f"embedded corpus, {float(cfg.max_corpus_mb):g} MB",
        "data.tokenizer": "trained" if trained else str(Path(str(cfg.tokenizer)).expanduser().resolve()),
        "data.vocab_size": int(cfg.vocab_size) if trained else None,
        "data.tokenizer_sample_mb": float(cfg.tokenizer_sample_mb) if trained else None,
        "data.val_fraction": float(cfg.val_fraction),
        "data.skip_bad_files": bool(cfg.skip_bad_files),
    }
    return folders.made_by("prepare", f"{len(files)} source file(s), sizes and times {digest}", settings)


def _legacy_record(folder: Path) -> dict[str, Any] | None:
    """A folder prepared before made_by.json: what its meta.json says."""
    meta = read_meta(folder)
    trained = meta.get("tokenizer") == "trained"
    settings = {
        "data.val_fraction": meta.get("val_fraction"),
        "data.vocab_size": meta["vocab_size"] if trained else None,
    }
    if trained:
        settings["data.tokenizer"] = "trained"
    return {"verb": "prepare", "settings": settings}  # no source: not compared


def claim_prepared(cfg: Any, out_dir: Path, overwrite: bool) -> bool:
    """`suite prepare` into `out_dir` under suite.folders' rule: True when it already holds the data this
    config makes, intact (nothing to do); False to build (a prepared folder there is then moved aside whole);
    ConfigError naming the difference, a new folder and --overwrite when it holds other data."""
    out_dir = Path(out_dir).expanduser()
    if not is_prepared(out_dir):
        return False
    sources, _ = _sources(cfg, Console(stderr=True, quiet=True))
    record = made_record(cfg, sources)
    then = folders.read_record(out_dir) or _legacy_record(out_dir)
    if not folders.differences(then, record):
        try:
            verify_prepared(out_dir)
        except ConfigError:  # damaged shards: rebuilt (their refusal says so), the old folder moved aside
            return False
        return True
    return not folders.check_claim(out_dir, record, "data.path", overwrite, legacy=_legacy_record)


def _tokenizer(
    cfg: Any, units: Any, pool: Pool, paths: list[str], work: Path, console: Console, bar: PrepareProgress
) -> Any:
    """Reuse `cfg.tokenizer`, or train one on a bounded sample of the training documents; saved into
    `work` (a rerun after a kill reuses one already trained there)."""
    if cfg.tokenizer:
        try:
            tokenizer = load_tokenizer(cfg.tokenizer)
        except ConfigError as err:
            raise ConfigError(f"data.tokenizer='{cfg.tokenizer}': {err}") from err
        if tokenizer.eos_token_id is None:
            raise ConfigError(
                f"data.tokenizer='{cfg.tokenizer}' has no end-of-text token to separate documents; "
                "use a tokenizer with an eos_token"
            )
        tokenizer.save_pretrained(str(work))
        return tokenizer
    if (work / TOKENIZER_DONE).is_file():
        shutil.rmtree(work / SAMPLE, ignore_errors=True)
        return load_tokenizer(work)
    done = complete_parts(work / SAMPLE)
    if done:
        console.print(f"resuming: {done} part(s) of the tokenizer sample already read in {work}")
    bar.start("sampling")
    budget = int(float(cfg.tokenizer_sample_mb) * 1_000_000)
    totals, sample = sample_pass(
        units(), pool, budget, len(paths), bar.tick, work / SAMPLE, _units_per_part(cfg)
    )
    _check_text(cfg, [SimpleNamespace(path=p) for p in paths], totals.counts)
    check_documents(len(totals.owners))
    train_ids, _ = split_documents(len(totals.owners), float(cfg.val_fraction))
    order = training_order(train_ids, totals.owners, 1)
    position = np.full(len(totals.owners), -1, dtype=np.int64)
    position[order] = np.arange(len(order))
    texts = [sample[i] for i in sorted((i for i in sample if position[i] >= 0), key=lambda i: position[i])]
    console.print(
        f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) on {len(texts):,} of "
        f"{len(train_ids):,} training documents"
    )
    train_tokenizer(texts, int(cfg.vocab_size), work)
    (work / TOKENIZER_DONE).write_text("done\n")
    shutil.rmtree(work / SAMPLE, ignore_errors=True)
    return load_tokenizer(work)


def _install(tmp: Path, out_dir: Path, key: str = "data.path") -> Path | None:
    """Move the finished folder into place. An older prepared folder there is moved aside to
    `<out_dir>.old-<N>` (suite.folders' rule for every folder the suite replaces: never deleted, a run
    may still read it) and the line says where; returns where it went (None: nothing was there)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return None
    _check_target(out_dir)
    moved = folders.move_aside(out_dir, key, "suite prepare")
    os.replace(tmp, out_dir)
    print(f"moved the previous prepared data in {out_dir} to {moved}", flush=True)
    return moved


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def verify_prepared(folder: str | Path) -> None:
    """Check the shards and tokenizer of a prepared folder against meta.json's sizes and sha256.

    One ConfigError line naming the first bad file. Sizes are always checked, checksums too: the
    files are read once per open (a few MB for the default corpus; for big shards this costs one
    sequential read per run start). Folders prepared before checksums existed are not checked.
    """
    folder = Path(folder).expanduser()
    listed = read_meta(folder).get("files") or {}
    hint = f"it is truncated or corrupt; run `suite prepare` again to rebuild {folder}"
    for name, info in listed.items():
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"data file '{path}' is missing; run `suite prepare` again to rebuild {folder}")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise ConfigError(f"data file '{path}' has {size} bytes, meta.json says {info['bytes']}; {hint}")
        if _sha256(path) != info["sha256"]:
            raise ConfigError(f"data file '{path}' does not match its sha256 in meta.json; {hint}")


def is_prepared(folder: Path) -> bool:
    """Whether folder holds meta.json and both splits' shards."""
    folder = Path(folder)
    names = [META_FILE] + [f"{s}{suffix}" for s in SPLITS for suffix in (".bin", ".idx")]
    return all((folder / n).is_file() for n in names)


def read_meta(folder: str | Path) -> dict[str, Any]:
    """meta.json of a prepared folder, checked for the format this suite reads."""
    path = Path(folder).expanduser() / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"data.path='{folder}' has no readable {META_FILE} ({type(err).__name__}); "
            f"run `suite prepare data.path={folder}` again"
        ) from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"data.path='{folder}' was prepared in format {meta.get('format_version')}, this suite reads "
            f"{FORMAT_VERSION}; run `suite prepare data.path={folder}` again"
        )
    return meta


def cache_root(cfg: Any) -> Path:
    return Path(cfg.cache_dir or "~/.cache/suite").expanduser()


def corpus_hash(max_mb: float) -> str:
    """The embedded corpus depends on the interpreter (its stdlib) and the size cap."""
    return hashlib.sha256(f"{sys.version}|{max_mb:g}".encode()).hexdigest()[:12]


def _default_folder(cfg: Any) -> Path:
    """Where data.path=None prepares: the embedded corpus, or a hash of the sources given."""
    extra = {"val_fraction": float(cfg.val_fraction), "tokenizer": cfg.tokenizer}
    if cfg.sources:
        key = {"sources": [source_fields(s) for s in cfg.sources], "vocab": int(cfg.vocab_size), **extra}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        return cache_root(cfg) / f"sources-v{FORMAT_VERSION}-{digest}"
    name = f"embedded-v{FORMAT_VERSION}-vocab{int(cfg.vocab_size)}-mb{float(cfg.max_corpus_mb):g}"
    defaults = DataConfig()
    if extra != {"val_fraction": defaults.val_fraction, "tokenizer": defaults.tokenizer}:
        name += "-" + hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root(cfg) / name


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent first runs build the default data only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def ensure_prepared(cfg: Any, progress: bool = True, summary: bool = True) -> Path:
    """The prepared folder training reads: `cfg.path` (checked), or the cached default, built once."""
    refuse_unguarded_main()
    if cfg.path:
        folder = Path(str(cfg.path)).expanduser()
        if not (folder / META_FILE).is_file():
            raise ConfigError(
                f"data.path='{cfg.path}' is not a prepared data folder (no {META_FILE}); "
                f"run `suite prepare data.path={cfg.path}` first"
            )
        read_meta(folder)
        for split in SPLITS:
            IndexedTokens(folder / split)  # validates sizes and headers now, not mid-training
        return folder
    folder = _default_folder(cfg)
    if not is_prepared(folder):
        check_replaceable("data.cache_dir", str(folder), WRITABLE_FIX["data.cache_dir"])
        with _file_lock(folder.with_name(f".{folder.name}.lock")):
            if not is_prepared(folder):
                prepare(cfg, folder, progress=progress, summary=summary, key="data.cache_dir")
    return folder
