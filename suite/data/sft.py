"""Supervised finetuning (SFT) data: chat rows -> masked, packed token rows -> data-parallel batches.

Pipeline, one function per step:

    iter_sft_rows(sources)              local .jsonl(.gz)/.json/.parquet files (glob/folder), a folder
                                        `datasets` saved, or a `datasets` name (files read by suite.user_files);
                                        yields (location, record), e.g. ("data/train.jsonl line 17", {...})
    normalize_record, encode_conversation
                                        a row's messages and assistant tokens (suite.data.chat)
    SFTDataset.build(...)               truncation, malformed-row policy, packing, padding; a report;
                                        `batch(rows)` gives the suite.data.batch.Batch a step consumes
    SFTBatches(dataset, ...)            suite.data.sampler.GlobalBatches over the dataset's rows

Only assistant tokens are targets: labels are IGNORE_INDEX on system/user/template tokens and
padding. Shifting: a sample of n tokens x_0..x_{n-1} becomes n-1 positions: tokens x_0..x_{n-2}
and labels[t] = x_{t+1} when x_{t+1} is an assistant token, else IGNORE_INDEX.

Packing. Samples are greedily packed into rows of `seq_len` in a seeded order; positions restart at
0 for every sample and `doc_ids` numbers the samples of a row (padding: -1), so attention inside
documents (suite.models.document_attention: per document, or the block-diagonal causal mask) lets
a packed sample see exactly what it would see alone. Without packing, one sample per row, right-padded; the
plain causal mask is then enough and `doc_ids` is None.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from suite import user_files
from suite.config.errors import ConfigError
from suite.config.schema import DataConfig, SFTDataConfig
from suite.data.batch import IGNORE_INDEX, Batch
from suite.data.chat import (
    INVALID_JSON,
    MalformedRow,
    conversation_segments,
    encode_texts,
    normalize_record,
    resolve_chat_template,
)
from suite.data.sampler import GlobalBatches
from suite.data.sources import match_local

_SFT_DEFAULTS = SFTDataConfig()  # recipe keys finetune.data.*: the one source of these defaults
_DATA_DEFAULTS = DataConfig()

SFT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
ENCODE_CHUNK = 1024


class SFTDataError(ConfigError):
    """on_error=fail met a malformed row; the message names its location (file and line)."""


# ---- reading rows --------------------------------------------------------------------------------
def _source_spec(source: Any) -> tuple[str, str, str | None]:
    """(path, split, name) of a source given as a string/Path or an object/dict with those fields."""
    if isinstance(source, (str, Path)):
        return str(source), "train", None
    get = source.get if isinstance(source, dict) else lambda k, d=None: getattr(source, k, d)
    return str(get("path")), str(get("split", "train") or "train"), get("name", None)


def _local_sft_files(pattern: str) -> list[Path] | None:
    """Files a local path/glob/folder names, or None when `pattern` looks like a `datasets` name."""
    files = match_local(pattern, SFT_SUFFIXES)
    if files is None:
        return None
    bad = [p for p in files if not p.name.endswith(SFT_SUFFIXES)]
    if not files or bad:
        found = f"matches '{bad[0]}', which is not" if bad else "matches no"
        raise ConfigError(
            f"SFT source '{pattern}' {found} {'/'.join(SFT_SUFFIXES)} files; give a file, folder or glob of "
            "chat rows, a folder `datasets` saved (save_to_disk), or a `datasets` name"
        )
    return files


def iter_sft_rows(sources: Any) -> Iterator[tuple[str, Any]]:
    """(location, record) for every row of every source, in a fixed order.

    `sources`: one source or a list; a source is a path/glob/folder string, a `datasets` name, or an
    object/dict with `path` (+ `split`, `name` for `datasets`). Locations are 1-based:
    "file.jsonl line 17", "file.parquet row 3", "org/set[train] row 9". A JSONL line that is not
    valid JSON yields a record that normalize_record reports as `invalid_json`.
    """
    if isinstance(sources, (str, Path)) or not isinstance(sources, Sequence):
        sources = [sources]
    for source in sources:
        path, split, name = _source_spec(source)
        if user_files.is_saved_dataset(path):
            ds = user_files.load_saved_dataset(path, split, "SFT source")
            yield from ((f"{path}[{split}] row {i}", record) for i, record in enumerate(ds, 1))
            continue
        files = _local_sft_files(path)
        if files is None:
            yield from _iter_datasets(path, split, name)
            continue
        rows = 0
        for file in files:
            if file.name.endswith(".json"):
                found = _iter_json(file)
            elif file.name.endswith(".parquet"):
                found = _iter_parquet(file)
            else:
                found = _iter_jsonl(file)
            for row in found:
                rows += 1
                yield row
        if not rows:
            where = f"'{files[0]}' is" if len(files) == 1 else f"its {len(files)} files are"
            raise ConfigError(
                f"SFT source '{path}' holds no rows: {where} empty; fill it, or drop the source"
            )


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for lineno, record in user_files.json_lines(path, "SFT source"):
        if isinstance(record, json.JSONDecodeError):
            record = (INVALID_JSON, record.msg)
        yield f"{path} line {lineno}", record


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    data = user_files.read_json(path, "SFT source")
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ConfigError(
            f"SFT source '{path}' must hold a JSON list of rows (or use .jsonl, one row a line)"
        )
    for i, record in enumerate(data, 1):
        yield f"{path} item {i}", record


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    for i, record in enumerate(user_files.read_parquet(path, "SFT source").to_pylist(), 1):
        yield f"{path} row {i}", record


def _iter_datasets(path: str, split: str, name: str | None) -> Iterator[tuple[str, Any]]:
    # deferred: datasets costs ~1-2 s to import; only a Hugging Face dataset source needs it
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as err:  # network, unknown name, bad split: one user-facing line
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"SFT source '{path}' is neither a local file nor a loadable `datasets` dataset ({reason}); "
            f"check the name, split and config name, or give a local {'/'.join(SFT_SUFFIXES)} path or a "
            "save_to_disk folder"
        ) from err
    for i, record in enumerate(ds, 1):
        yield f"{path}[{split}] row {i}", record


# ---- the dataset -----------------------------------------------------------------------------------
@dataclass
class SFTOptions:
    """How rows become training rows (defaults: finetune.data.* and data.seq_len in the schema).

    seq_len: tokens per row (the model sees seq_len positions; a sample may hold seq_len + 1 tokens).
    template: see resolve_chat_template ("auto": the tokenizer's own, else chatml).
    packing: several samples per row (block-diagonal mask, positions restart per sample).
    truncation: "truncate" drops tokens from the left (system/earlier turns/prompt start) until the
        sample fits, as long as the final assistant reply stays whole; "skip" treats every
        over-long sample as malformed (kind too_long). Samples whose final reply alone does not fit
        are too_long either way.
    on_error: "skip" counts malformed rows and goes on; "fail" raises SFTDataError at the first,
        naming its file and line.
    system_prompt: added to rows that have no system message.
    shuffle_seed: the order in which samples are packed into rows.
    key: the config key prefix named in error messages.
    """

    seq_len: int = _DATA_DEFAULTS.seq_len
    template: str = _SFT_DEFAULTS.template
    packing: bool = _SFT_DEFAULTS.packing
    truncation: str = _SFT_DEFAULTS.truncation
    on_error: str = _SFT_DEFAULTS.on_error
    system_prompt: str | None = _SFT_DEFAULTS.system_prompt
    shuffle_seed: int = 0
    key: str = "finetune.data"

    def check(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"{self.key}.seq_len={self.seq_len} must be >= 2; e.g. 256")
        if self.truncation not in ("truncate", "skip"):
            raise ConfigError(f"{self.key}.truncation={self.truncation!r}; use truncate or skip")
        if self.on_error not in ("skip", "fail"):
            raise ConfigError(f"{self.key}.on_error={self.on_error!r}; use skip or fail")


@dataclass
class SFTReport:
    """What happened to the rows: counts and the first location of each kind of problem."""

    rows: int = 0
    samples: int = 0
    malformed: Counter = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)
    truncated: int = 0
    sample_tokens: int = 0  # positions used by samples (tokens - 1 each)
    target_tokens: int = 0
    num_rows: int = 0  # training rows after packing/padding
    seq_len: int = 0

    @property
    def num_malformed(self) -> int:
        return sum(self.malformed.values())

    @property
    def fill(self) -> float:
        """Fraction of row positions that hold sample tokens (the rest is padding)."""
        return self.sample_tokens / max(1, self.num_rows * self.seq_len)

    def summary(self) -> str:
        text = (
            f"{self.rows:,} rows -> {self.samples:,} samples in {self.num_rows:,} rows of {self.seq_len} "
            f"({self.fill:.0%} filled, {self.target_tokens:,} target tokens)"
        )
        if self.truncated:
            text += f"; {self.truncated:,} truncated from the left"
        if self.malformed:
            parts = [
                f"{kind} {n:,} (first: {self.first_error[kind]})"
                for kind, n in sorted(self.malformed.items())
            ]
            text += f"; {self.num_malformed:,} malformed rows skipped: " + "; ".join(parts)
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "samples": self.samples,
            "malformed": dict(self.malformed),
            "first_error": dict(self.first_error),
            "truncated": self.truncated,
            "sample_tokens": self.sample_tokens,
            "target_tokens": self.target_tokens,
            "num_rows": self.num_rows,
            "seq_len": self.seq_len,
            "fill": round(self.fill, 4),
        }


def _fit(
    ids: list[int], flags: list[bool], seq_len: int, truncation: str
) -> tuple[list[int], list[bool], bool]:
    """Truncate from the left to seq_len + 1 tokens; raises MalformedRow(too_long) when impossible."""
    if len(ids) <= seq_len + 1:
        return ids, flags, False
    last_start = len(flags)  # first token of the final assistant reply
    while last_start > 0 and flags[last_start - 1]:
        last_start -= 1
    reply = len(ids) - last_start
    if truncation == "skip" or reply + 1 > seq_len + 1:
        why = (
            f"the final assistant reply alone is {reply} tokens"
            if reply + 1 > seq_len + 1
            else f"{len(ids) - 1} tokens"
        )
        raise MalformedRow("too_long", f"{why}, more than seq_len={seq_len} allows")
    cut = len(ids) - (seq_len + 1)
    return ids[cut:], flags[cut:], True


class SFTDataset:
    """Packed/padded training rows ([num_rows, seq_len] int32 arrays) and the report that made them."""

    def __init__(
        self,
        tokens: np.ndarray,
        labels: np.ndarray,
        positions: np.ndarray,
        doc_ids: np.ndarray | None,
        report: SFTReport,
        template: str,
    ) -> None:
        self.tokens, self.labels, self.positions, self.doc_ids = tokens, labels, positions, doc_ids
        self.report = report
        self.template = template
        self.seq_len = int(tokens.shape[1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, rows: np.ndarray | Sequence[int]) -> Batch:
        rows = np.asarray(rows, dtype=np.int64)
        get = lambda a: torch.from_numpy(a[rows].astype(np.int64))  # noqa: E731
        return Batch(
            get(self.tokens),
            get(self.labels),
            get(self.positions),
            None if self.doc_ids is None else get(self.doc_ids),
        )

    def too_small(self, global_batch_size: int, split: str) -> str:
        return (
            f"the SFT {split} split packs into {len(self):,} rows of {self.seq_len} tokens, fewer than one global "
            f"batch (parallel.global_batch_size={global_batch_size}); lower the global batch size or seq_len, or "
            "add rows"
        )

    def resume_mismatch(self, saved_samples: int) -> str | None:
        if saved_samples == len(self):
            return None
        return (
            f"the SFT data now packs into {len(self):,} rows but the checkpoint was trained on {saved_samples:,}; "
            "resume with the same data, seq_len and packing, or start a new run"
        )

    @classmethod
    def build(cls, sources: Any, tokenizer: Any, options: SFTOptions | None = None) -> SFTDataset:
        """Read, normalise, render, tokenize, check, truncate, pack and pad every row of `sources`."""
        return cls.from_rows(iter_sft_rows(sources), tokenizer, options)

    @classmethod
    def from_rows(
        cls, rows: Iterable[tuple[str, Any]], tokenizer: Any, options: SFTOptions | None = None
    ) -> SFTDataset:
        """Like build, from (location, record) pairs (e.g. generated in memory)."""
        opts = options or SFTOptions()
        opts.check()
        if tokenizer.eos_token is None:
            raise ConfigError("the tokenizer has no eos token; SFT needs one to end each assistant turn")
        template = resolve_chat_template(tokenizer, opts.template)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        report = SFTReport(seq_len=opts.seq_len)
        samples: list[tuple[np.ndarray, np.ndarray]] = []
        pending: list[tuple[str, list[tuple[str, bool]]]] = []

        def bad(location: str, err: MalformedRow) -> None:
            if opts.on_error == "fail":
                raise SFTDataError(
                    f"{location}: {err.detail} [{err.kind}]; fix or remove the row, or set "
                    f"{opts.key}.on_error=skip to skip malformed rows"
                )
            report.malformed[err.kind] += 1
            report.first_error.setdefault(err.kind, f"{location}: {err.detail}")

        def flush() -> None:
            texts = [text for _, pieces in pending for text, _ in pieces]
            encoded = iter(encode_texts(tokenizer, texts)) if texts else iter(())
            for location, pieces in pending:
                ids: list[int] = []
                flags: list[bool] = []
                for _, flag in pieces:
                    piece = next(encoded)
                    ids.extend(piece)
                    flags.extend([flag] * len(piece))
                try:
                    ids, flags, cut = _fit(ids, flags, opts.seq_len, opts.truncation)
                except MalformedRow as err:
                    bad(location, err)
                    continue
                arr = np.asarray(ids, dtype=np.int64)
                target = np.asarray(flags[1:], dtype=bool)
                if not target.any():
                    bad(location, MalformedRow("empty_response", "no assistant tokens remain"))
                    continue
                report.truncated += int(cut)
                samples.append((arr, np.where(target, arr[1:], IGNORE_INDEX)))
            pending.clear()

        for location, record in rows:
            report.rows += 1
            try:
                messages = normalize_record(record, opts.system_prompt)
                pending.append((location, conversation_segments(tokenizer, messages, template)))
            except MalformedRow as err:
                flush()  # keep failures in row order
                bad(location, err)
            if len(pending) >= ENCODE_CHUNK:
                flush()
        flush()
        if not samples:
            first = next(iter(report.first_error.values()), "the sources hold no rows")
            raise ConfigError(
                f"no usable SFT samples in {report.rows:,} rows ({dict(report.malformed) or 'empty'}); first "
                f"problem: {first}"
            )
        report.samples = len(samples)
        report.sample_tokens = sum(len(ids) - 1 for ids, _ in samples)
        report.target_tokens = int(sum((lab != IGNORE_INDEX).sum() for _, lab in samples))
        arrays = pack_samples(samples, opts.seq_len, pad_id, opts.packing, opts.shuffle_seed)
        report.num_rows = int(arrays[0].shape[0])
        return cls(*arrays, report=report, template=template)


def pack_samples(
    samples: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    packing: bool = True,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens, labels, positions, doc_ids) int32 arrays [rows, seq_len] from (ids, shifted labels) samples.

    A sample of n ids occupies n-1 positions (inputs ids[:-1], labels already aligned). With packing,
    samples are taken in a seeded order and a new row starts when the next one does not fit.
    Padding: pad_id tokens, -100 labels, position 0, doc id -1.
    """
    order = np.random.default_rng(seed).permutation(len(samples)) if packing else np.arange(len(samples))
    rows: list[list[int]] = []
    used = seq_len
    for i in order:
        n = len(samples[i][0]) - 1
        if not packing or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(int(i))
        used += n
    shape = (len(rows), seq_len)
    tokens = np.full(shape, pad_id, dtype=np.int32)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(shape, dtype=np.int32)
    doc_ids = np.full(shape, -1, dtype=np.int32)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            ids, labs = samples[i]
            n = len(ids) - 1
            tokens[r, at : at + n] = ids[:-1]
            labels[r, at : at + n] = labs
            positions[r, at : at + n] = np.arange(n)
            doc_ids[r, at : at + n] = d
            at += n
        if not packing:
            positions[r, at:] = np.arange(at, seq_len)  # the causal mask already hides these pads
    return tokens, labels, positions, doc_ids if packing else None


def load_sft_dataset(sources: Any, tokenizer: Any, options: SFTOptions | None = None) -> SFTDataset:
    """SFTDataset.build, under the name the rest of the suite uses."""
    return SFTDataset.build(sources, tokenizer, options)


# ---- the step iterator ---------------------------------------------------------------------------
class SFTBatches(GlobalBatches):
    """GlobalBatches over an SFTDataset's rows (resumable; refuses data that now packs differently)."""

    def __init__(
        self,
        dataset: SFTDataset,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        super().__init__(
            dataset,
            micro_batch_size,
            global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            split=split,
        )
        self.dataset = dataset
