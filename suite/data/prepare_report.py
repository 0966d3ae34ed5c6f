"""What `suite prepare` shows: a progress bar (MB read, MB/s of text, tokens/s, ETA when the sources'
size is known) and, at the end, one screen: per source the documents, tokens, duplicates, filtered,
its share of the training tokens and how many times a pass of the mixture reads it (epochs)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from suite.data.parts import COUNTS, DOCS
from suite.data.streams import Reading


class _Rates(ProgressColumn):
    """MB read from disk (what the ETA counts), MB/s of text (decompressed: .gz/.zst and Parquet read
    fewer bytes than they hold) and tokens/s, since the pass started."""

    def render(self, task: Task) -> Text:
        elapsed = max(task.elapsed or 0.0, 1e-6)
        done = task.completed / 1e6
        total = f"/{task.total / 1e6:,.0f}" if task.total else ""
        text = task.fields.get("text_bytes", 0) / 1e6
        tokens = task.fields.get("tokens", 0)
        rate = f", {tokens / elapsed:,.0f} tokens/s" if tokens else ""
        return Text(f"{done:,.1f}{total} MB read, {text / elapsed:,.1f} MB/s of text{rate}")


class PrepareProgress:
    """The bar of one pass at a time (sampling for the tokenizer, tokenizing), fed by bytes read."""

    def __init__(self, console: Console, total: int | None, enabled: bool, reading: Reading) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            _Rates(),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
            transient=True,
        )
        self.total = total
        self.task: Any = None
        self.tokens = self.text_bytes = self.pass_text = 0
        self.started = time.monotonic()
        reading.on_bytes = self._read

    def start(self, phase: str) -> None:
        """A new pass: the bar restarts from 0."""
        if self.task is not None:
            self._progress.remove_task(self.task)
        self.tokens = self.pass_text = 0
        self.task = self._progress.add_task(phase, total=self.total, tokens=0, text_bytes=0)

    def _read(self, n: int) -> None:
        if self.task is not None:
            self._progress.advance(self.task, n)

    def tick(self, text_bytes: int, tokens: int) -> None:
        """A unit's results arrived: its text and tokens."""
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.pass_text += text_bytes
        if self.task is not None:
            self._progress.update(self.task, tokens=self.tokens, text_bytes=self.pass_text)

    def __enter__(self) -> PrepareProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)


def describe_sources(
    records: list[dict[str, Any]], counts: np.ndarray, ranges: list[list[int]]
) -> list[dict[str, Any]]:
    """meta.json's record of each source: its fields, what was read and kept, and its mixture share.

    `share`: the normalised weight, the share of training tokens the loader draws from it (exactly, up
    to one sample); `data_share`: its share of the prepared training tokens; `epochs`: how many times
    one pass of the mixture (as many tokens as the training split holds) reads its training tokens
    (above 1: upsampled, below: downsampled)."""
    weights = np.asarray([float(r["weight"]) for r in records], dtype=np.float64)
    shares = weights / weights.sum()
    train = np.asarray([end - start for start, end in ranges], dtype=np.float64)
    total = float(train.sum())
    described = []
    for i, record in enumerate(records):
        row = counts[i]
        described.append(
            {
                **record,
                "num_docs": int(row[DOCS]),
                **{name: int(row[column]) for column, name in enumerate(COUNTS)},
                "train_tokens": int(train[i]),
                "share": round(float(shares[i]), 6),
                "data_share": round(float(train[i] / total), 6) if total else 0.0,
                "epochs": round(float(shares[i] * total / train[i]), 4) if train[i] else None,
            }
        )
    return described


def print_report(console: Console, out_dir: Path, meta: dict[str, Any], seconds: float) -> None:
    """The end of `suite prepare`: one table and a few lines."""
    table = Table(title=f"prepared {out_dir}", title_justify="left")
    for name in ("source", "documents", "tokens", "duplicates", "filtered", "share", "epochs"):
        table.add_column(name, justify="left" if name == "source" else "right")
    text_bytes = tokens = 0
    for s in meta["sources"]:
        epochs = "-" if s.get("epochs") is None else f"{s['epochs']:.2f}"
        if s.get("epochs") and s["epochs"] > 1.0:
            epochs += " (up)"
        table.add_row(
            str(s["path"]),
            f"{s['documents']:,}",
            f"{s['tokens']:,}",
            f"{s['duplicates']:,}",
            f"{s['filtered'] + s['bad_records']:,}",
            f"{s['share']:.1%}",
            epochs,
        )
        text_bytes += s["text_bytes"]
        tokens += s["tokens"]
    console.print(table)
    seconds = max(seconds, 1e-6)
    console.print(
        f"{meta['num_train_tokens']:,} train / {meta['num_val_tokens']:,} val tokens "
        f"({meta['num_train_docs']:,} / {meta['num_val_docs']:,} documents), vocab {meta['vocab_size']}; "
        f"{seconds:.1f} s, {text_bytes / 1e6 / seconds:,.1f} MB/s of text, {tokens / seconds:,.0f} tokens/s"
    )
    if meta.get("skipped_files"):
        files = meta["skipped_files"]
        console.print(
            f"[yellow]skipped {len(files)} unreadable file(s)[/]: {', '.join(files[:3])}"
            + (" ..." if len(files) > 3 else "")
        )
