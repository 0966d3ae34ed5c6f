"""`suite prepare`: text sources -> tokenizer + train/val token shards + meta.json, atomically.

The output folder appears only when complete (built in a temporary sibling, then renamed), so
a crash or Ctrl-C never leaves a half-prepared folder that training would trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from suite.config.errors import ConfigError
from suite.config.schema import DataConfig
from suite.data.corpus import build_embedded_corpus, read_corpus
from suite.data.shards import IndexedTokens, ShardWriter
from suite.data.sources import read_source, source_fields
from suite.data.tokenizer import load_tokenizer, train_tokenizer
from suite.output_paths import check_replaceable

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent first runs just both build
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
CHECKED_FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json")
# The tokenizer learns merges from at most this much text (a shuffled sample of the training mix):
# more barely changes the merges but costs time and memory on big corpora.
TOKENIZER_SAMPLE_MB = 64.0
ENCODE_CHUNK = 512
_SPLIT_SEED, _WEIGHT_SEED, _ORDER_SEED = 20240501, 20240502, 20240503
# what to do when the place a prepared folder goes cannot be written
WRITABLE_FIX = {
    "data.path": "give a folder you can write, e.g. data.path=data/prepared",
    "data.cache_dir": "give a cache folder you can write, e.g. data.cache_dir=~/.cache/suite, or data.path=DIR",
}


def prepare(
    cfg: Any, out_dir: Path, progress: bool = True, summary: bool = True, key: str = "data.path"
) -> Path:
    """Prepare `cfg.sources` (or the embedded corpus when empty) into `out_dir`; return `out_dir`.
    `summary`: end with a `prepared ...` line (with `progress`); `suite prepare` prints its own.
    `key`: the setting that named `out_dir`, for the one-line refusal of a place that cannot be written."""
    out_dir = Path(out_dir).expanduser()
    _check_config(cfg)
    _check_target(out_dir)
    check_replaceable(key, str(out_dir), WRITABLE_FIX.get(key, WRITABLE_FIX["data.path"]))
    console = Console(stderr=True, quiet=not progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        texts, owners, sources_meta = _load_documents(cfg, console)
        train_ids, val_ids = split_documents(len(texts), float(cfg.val_fraction))
        train_order = weighted_order(train_ids, owners, [s["weight"] for s in sources_meta])
        tokenizer = _tokenizer(cfg, [texts[i] for i in train_order], tmp, console)
        eos_id = tokenizer.eos_token_id
        vocab = len(tokenizer)
        _encode_all(tokenizer, texts, eos_id, tmp / "all", vocab, progress, console)
        everything = IndexedTokens(tmp / "all")
        counts = {}
        for split, order in (("train", train_order), ("val", val_ids)):
            with ShardWriter(tmp / split, vocab) as writer:
                for i in order:
                    writer.add_document(everything.document(int(i)))
            counts[split] = (writer.num_docs, writer.num_tokens)
        del everything
        for suffix in (".bin", ".idx"):
            (tmp / f"all{suffix}").unlink()
        meta = {
            "format_version": FORMAT_VERSION,
            "vocab_size": vocab,
            "eos_id": eos_id,
            "pad_id": tokenizer.pad_token_id,
            "num_train_tokens": counts["train"][1],
            "num_val_tokens": counts["val"][1],
            "num_train_docs": counts["train"][0],
            "num_val_docs": counts["val"][0],
            "val_fraction": float(cfg.val_fraction),
            "tokenizer": str(cfg.tokenizer) if cfg.tokenizer else "trained",
            "sources": sources_meta,
            # sizes + sha256 of the files training reads, checked by verify_prepared() on every open
            "files": {name: _file_record(tmp / name) for name in CHECKED_FILES if (tmp / name).is_file()},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if summary:
        console.print(
            f"[green]prepared[/] {out_dir}: {counts['train'][1]:,} train / {counts['val'][1]:,} val tokens, "
            f"vocab {vocab}"
        )
    return out_dir


def _check_config(cfg: Any) -> None:
    if not 0.0 <= float(cfg.val_fraction) < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1); e.g. 0.02")
    if not cfg.sources and not float(cfg.max_corpus_mb) > 0:
        raise ConfigError(f"data.max_corpus_mb={cfg.max_corpus_mb} must be > 0; e.g. 8")


def _check_target(out_dir: Path) -> None:
    """Refuse to replace a folder that holds something other than prepared data."""
    if out_dir.exists() and not is_prepared(out_dir) and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(
            f"data.path='{out_dir}' already exists and is not a prepared data folder; "
            "choose a new or empty folder so nothing of yours is overwritten"
        )


def _load_documents(cfg: Any, console: Console) -> tuple[list[str], np.ndarray, list[dict[str, Any]]]:
    """All unique documents, the source index of each, and a meta.json record per source."""
    texts: list[str] = []
    owners: list[int] = []
    sources_meta: list[dict[str, Any]] = []
    if cfg.sources:
        for index, src in enumerate(cfg.sources):
            docs = read_source(src, index)
            console.print(f"source {index}: {src.path} -> {len(docs):,} documents")
            texts.extend(docs)
            owners.extend([index] * len(docs))
            sources_meta.append({**source_fields(src), "num_docs": len(docs)})
    else:
        corpus_dir = cache_root(cfg) / f"embedded-corpus-{corpus_hash(float(cfg.max_corpus_mb))}"
        console.print(
            f"building the embedded corpus (Python docstrings, {cfg.max_corpus_mb} MB) in {corpus_dir}"
        )
        corpus = build_embedded_corpus(corpus_dir, float(cfg.max_corpus_mb))
        texts = [t for t in read_corpus(corpus) if t.strip()]
        owners = [0] * len(texts)
        sources_meta.append(
            {
                "path": "embedded:python-docstrings",
                "weight": 1.0,
                "corpus": str(corpus),
                "num_docs": len(texts),
            }
        )
    if len(texts) < 2:
        raise ConfigError(
            f"data.sources hold {len(texts)} non-empty document(s); a train/val split needs at least 2 — add text"
        )
    return texts, np.asarray(owners, dtype=np.int64), sources_meta


def split_documents(num_docs: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val document ids (sorted); at least one of each."""
    num_val = min(max(1, round(val_fraction * num_docs)), num_docs - 1)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(num_docs)
    return np.sort(perm[num_val:]), np.sort(perm[:num_val])


def weighted_order(doc_ids: np.ndarray, owners: np.ndarray, weights: list[float]) -> np.ndarray:
    """Training documents blended by source weight, then shuffled so sources interleave.

    A source with weight w contributes floor(w) copies of each of its documents plus a seeded
    sample of round(frac(w) * n) more, so 0.5 halves it and 2.0 doubles it, deterministically.
    """
    picked = []
    for source, weight in enumerate(weights):
        mine = doc_ids[owners[doc_ids] == source]
        whole = int(weight)
        extra = round((weight - whole) * len(mine))
        rng = np.random.default_rng([_WEIGHT_SEED, source])
        picked.extend([mine] * whole)
        picked.append(np.sort(mine[rng.permutation(len(mine))[:extra]]))
    order = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    if not len(order):
        raise ConfigError("data.sources weights leave no training documents; raise data.sources[*].weight")
    return order[np.random.default_rng(_ORDER_SEED).permutation(len(order))]


def _tokenizer(cfg: Any, train_texts: list[str], out_dir: Path, console: Console) -> Any:
    """Reuse `cfg.tokenizer` or train one on a sample of the training mix; saved into out_dir."""
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
        tokenizer.save_pretrained(str(out_dir))
        return tokenizer
    console.print(f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size})")
    train_tokenizer(_sample(train_texts, TOKENIZER_SAMPLE_MB), int(cfg.vocab_size), out_dir)
    return load_tokenizer(out_dir)


def _sample(texts: list[str], max_mb: float) -> Iterator[str]:
    """The first texts up to max_mb (characters as a cheap byte proxy)."""
    budget = int(max_mb * 1_000_000)
    for text in texts:
        if budget <= 0:
            return
        budget -= len(text)
        yield text


def _encode_all(
    tokenizer: Any, texts: list[str], eos_id: int, prefix: Path, vocab: int, progress: bool, console: Console
) -> None:
    """Tokenize every unique document once (EOS appended) into one scratch shard."""
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    columns = [TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with (
        Progress(*columns, console=console, disable=not progress, transient=True) as bar,
        ShardWriter(prefix, vocab) as writer,
    ):
        task = bar.add_task("tokenizing", total=len(texts))
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            for enc in encode(chunk, add_special_tokens=False):
                ids = np.asarray(enc.ids, dtype=np.int64)
                writer.add_document(np.append(ids, eos_id))
            bar.advance(task, len(chunk))


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished folder into place, replacing an older prepared folder if there is one."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    _check_target(out_dir)
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


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
