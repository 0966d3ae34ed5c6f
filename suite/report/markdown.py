"""report.md's text: a run's numbers, its plots and the settings that shaped it; or a comparison table."""

from __future__ import annotations

import os
import statistics
from datetime import datetime
from pathlib import Path

from suite.report.runs import RunMetrics

SETTINGS = [
    "model.name",
    "model.num_layers",
    "model.hidden_size",
    "model.num_heads",
    "model.vocab_size",
    "model.init_from",
    "distill.teacher",
    "data.seq_len",
    "parallel.global_batch_size",
    "parallel.micro_batch_size",
    "train.max_steps",
    "train.precision",
    "optim.name",
    "optim.lr",
    "sched.name",
]
TITLES = {
    "loss.png": "Loss and validation loss",
    "lr.png": "Learning rate",
    "tokens_per_s.png": "Tokens per second",
    "mfu.png": "MFU",
    "memory.png": "Peak memory",
}


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _median(run: RunMetrics, key: str) -> float | None:
    values = run.series(key)[1]
    return statistics.median(values) if values else None


def _best(run: RunMetrics, key: str) -> str:
    steps, values = run.series(key)
    if not values:
        return "n/a"
    i = min(range(len(values)), key=values.__getitem__)
    return f"{values[i]:.4f} (step {steps[i]})"


def _peak(run: RunMetrics, key: str) -> float | None:
    values = run.series(key)[1]
    return max(values) if values else None


def _mfu(run: RunMetrics) -> str:
    value = _median(run, "mfu")
    return "n/a (no peak FLOP/s for this device)" if value is None else f"{100 * value:.1f}%"


def _stamp() -> str:
    return datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def run_markdown(run: RunMetrics, plots: list[Path], where: Path) -> str:
    """A run's report.md; `plots` are linked relative to `where` (the folder report.md is written in)."""
    steps = [r["step"] for r in run.records]
    bad = run.last("bad_steps")
    rows = [
        ("steps logged", f"{min(steps)} to {max(steps)} ({len(run.records)} records)"),
        ("final train loss", _num(run.last("loss"))),
        ("final validation loss", _num(run.last("val_loss"))),
        ("best validation loss", _best(run, "val_loss")),
        ("tokens/s (median)", _num(_median(run, "tokens_per_s"), ",.0f")),
        ("MFU (median)", _mfu(run)),
        ("peak memory (GB)", _num(_peak(run, "mem_gb"), ".2f")),
        ("learning rate (peak, final)", f"{_num(_peak(run, 'lr'), '.2e')}, {_num(run.last('lr'), '.2e')}"),
        ("bad steps (skipped)", "n/a" if bad is None else str(int(bad))),
    ]
    lines = [f"# Run report: {run.label}", "", f"From `{run.path}/metrics.jsonl`, written {_stamp()}.", ""]
    lines += ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), ""]
    if plots:
        lines += ["## Plots", ""]
        for plot in plots:
            title = TITLES.get(plot.name, plot.stem)
            lines += [f"### {title}", "", f"![{title}]({_relative(plot, where)})", ""]
    settings = [(key, run.setting(key)) for key in SETTINGS]
    settings = [(key, value) for key, value in settings if value not in (None, "", [])]
    if settings:
        lines += ["## Settings", "", "From config.yaml (the resolved config).", ""]
        lines += ["| key | value |", "|---|---|", *(f"| `{k}` | `{v}` |" for k, v in settings), ""]
    return "\n".join(lines)


def compare_markdown(runs: list[RunMetrics], figure: Path, where: Path) -> str:
    """report.md comparing `runs`: the loss figure and one table row per run."""
    header = [
        "run",
        "model",
        "steps",
        "final loss",
        "final val loss",
        "best val loss",
        "tokens/s (median)",
        "MFU (median)",
        "peak GB",
    ]
    lines = [f"# Comparing {len(runs)} runs", "", f"Written {_stamp()}.", ""]
    lines += [f"![Loss and validation loss]({_relative(figure, where)})", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [
            f"`{run.label}`",
            str(run.setting("model.name") or "n/a"),
            str(max(r["step"] for r in run.records)),
            _num(run.last("loss")),
            _num(run.last("val_loss")),
            _best(run, "val_loss"),
            _num(_median(run, "tokens_per_s"), ",.0f"),
            _mfu(run).split(" ")[0],
            _num(_peak(run, "mem_gb"), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each run's own report: `suite report <run>` (written into the run folder)."]
    return "\n".join(lines) + "\n"


def _relative(path: Path, where: Path) -> str:
    return Path(os.path.relpath(path.resolve(), where.resolve())).as_posix()
