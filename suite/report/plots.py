"""PNG plots of run metrics, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from suite.report.runs import RunMetrics

SIZE = (8.0, 4.5)  # inches; at DPI: 800 x 450 pixels
DPI = 100
# file name -> (title, y label, [(metrics key, legend)])
PANELS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "loss.png": ("Loss", "loss", [("loss", "train loss"), ("val_loss", "validation loss")]),
    "lr.png": ("Learning rate", "lr", [("lr", "lr")]),
    "tokens_per_s.png": ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")]),
    "mfu.png": ("Model FLOPs utilisation", "MFU", [("mfu", "MFU")]),
    "memory.png": ("Peak memory", "GB", [("mem_gb", "peak memory (GB)")]),
}


def _figure(width: float = SIZE[0], height: float = SIZE[1], columns: int = 1):
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def _line(axes, steps: list[int], values: list[float], label: str) -> None:
    axes.plot(steps, values, label=label, marker="o" if len(steps) <= 25 else None, markersize=3)


def _finish(axes, title: str, ylabel: str) -> None:
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()


def plot_run(run: RunMetrics, folder: Path) -> list[Path]:
    """One PNG per panel whose metrics the run logged (MFU only where a peak applied); their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, lines) in PANELS.items():
        present = [(key, legend) for key, legend in lines if run.has(key)]
        if not present:
            continue
        figure, (axes,) = _figure()
        for key, legend in present:
            _line(axes, *run.series(key), legend)
        _finish(axes, f"{title}: {run.label}", ylabel)
        figure.savefig(folder / name)
        written.append(folder / name)
    return written


def plot_comparison(runs: list[RunMetrics], path: Path) -> Path:
    """One figure: the runs' training loss curves (left) and validation loss (right), a line per run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (train, val) = _figure(2 * SIZE[0], SIZE[1], columns=2)
    for run in runs:
        _line(train, *run.series("loss"), run.label)
        _line(val, *run.series("val_loss"), run.label)
    _finish(train, "Training loss", "loss")
    _finish(val, "Validation loss", "val_loss")
    figure.savefig(path)
    return path
