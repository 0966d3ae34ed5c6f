"""Put a report in a folder: a run's report.md + plots/, or a comparison of runs; and the end-of-run
hook that never fails a run (a plotting error becomes one warning line)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from suite.config.errors import ConfigError
from suite.outputs import check_output_folder
from suite.report.markdown import compare_markdown, run_markdown
from suite.report.plots import PANELS, plot_comparison, plot_run
from suite.report.runs import load_run

REPORT = "report.md"
PLOTS = "plots"
COMPARISON = "loss_comparison.png"


def _out_folder(out: str | Path) -> Path:
    """The report's folder, created; a file, or a place that cannot be written (/proc, a read-only
    mount), is one line before anything is drawn."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"suite report: out='{out}' is a file, not a folder; pass out=<a folder>")
    check_output_folder("suite report: out", str(out), "pass out=<a folder you can write>")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def report_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[Path]]:
    """report.md and plots/*.png of one run, in `out` (default: the run folder). Returns their paths."""
    run = load_run(run_dir)
    folder = _out_folder(out if out is not None else run.path)
    plots_dir = folder / PLOTS
    for name in PANELS:  # a panel the run no longer has (a rerun without MFU) must not linger
        (plots_dir / name).unlink(missing_ok=True)
    plots = plot_run(run, plots_dir)
    report = folder / REPORT
    report.write_text(run_markdown(run, plots, folder))
    return report, plots


def default_comparison_folder() -> Path:
    return Path("reports") / datetime.now().strftime("compare-%Y%m%d-%H%M%S")


def compare_runs(run_dirs: list[str], out: str | Path | None = None) -> tuple[Path, list[Path]]:
    """One figure of the runs' loss and validation loss curves and a report.md with a table comparing
    them, in `out` (default: reports/compare-<timestamp>/). Returns (report.md, [the figure])."""
    runs = [load_run(path) for path in run_dirs]  # every run is checked before anything is written
    folder = _out_folder(out if out is not None else default_comparison_folder())
    figure = plot_comparison(runs, folder / COMPARISON)
    report = folder / REPORT
    report.write_text(compare_markdown(runs, figure, folder))
    return report, [figure]


def report_at_end(run_dir: Path, say: Callable[[str], None]) -> tuple[Path, list[Path]] | None:
    """The report of a run that has just finished; None (after one warning line) where it could not be
    written: a report never fails the run it describes."""
    try:
        report, plots = report_run(run_dir)
    except Exception as exc:  # noqa: BLE001 (plotting, a full disk, odd metrics: the run itself is fine)
        message = str(exc).splitlines()[0] if str(exc) else ""
        say(
            f"warning: no {REPORT} for {run_dir} ({type(exc).__name__}: {message}); `suite report {run_dir}` retries"
        )
        return None
    say(f"wrote {report} ({', '.join(p.name for p in plots)} in {report.parent / PLOTS}/)")
    return report, plots
