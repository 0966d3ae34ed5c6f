"""Put a report in a folder: a run's report.md + plots/, or a comparison of runs; and the end-of-run
hook that never fails a run (a plotting error becomes one warning line)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from suite import folders
from suite.config.errors import ConfigError
from suite.output_paths import check_output_folder, instead
from suite.report.markdown import compare_markdown, run_markdown
from suite.report.plots import PANELS, plot_comparison, plot_run
from suite.report.runs import load_run

REPORT = "report.md"
PLOTS = "plots"
COMPARISON = "loss_comparison.png"


def _out_folder(out: str | Path, runs: list[Path] | None = None, overwrite: bool = False) -> Path:
    """The report's folder, created; a file, or a place that cannot be written (/proc, a read-only
    mount), is one line before anything is drawn. `runs`: the runs reported, when `out` is not the
    one run's own folder: `out` must then be new, empty, or a report of the same runs (its
    made_by.json; suite.folders.claim): another run's folder or report is refused, or moved aside
    with --overwrite."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"suite report: out='{out}' is a file, not a folder; pass out={instead(folder)} (a new folder)"
        )
    check_output_folder("suite report: out", str(out), "pass out={folder} (a folder you can write)")
    if runs is not None:
        made = folders.made_by("report", [str(Path(r).resolve()) for r in runs], {})
        folders.claim(folder, made, "out", overwrite, legacy=_legacy, reads=tuple(runs))
        folders.write_record(folder, made)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _legacy(folder: Path) -> dict | None:
    """A report folder written before made_by.json holds nothing but the report's own files."""
    own = {REPORT, PLOTS, COMPARISON}
    return {"verb": "report"} if all(p.name in own for p in folder.iterdir()) else None


def report_run(
    run_dir: str | Path, out: str | Path | None = None, overwrite: bool = False
) -> tuple[Path, list[Path]]:
    """report.md and plots/*.png of one run, in `out` (default: the run folder). Returns their paths."""
    run = load_run(run_dir)
    own = out is None or Path(out).expanduser().resolve() == Path(run.path).resolve()
    folder = _out_folder(run.path if own else out, None if own else [run.path], overwrite)
    plots_dir = folder / PLOTS
    for name in PANELS:  # a panel the run no longer has (a rerun without MFU) must not linger
        (plots_dir / name).unlink(missing_ok=True)
    plots = plot_run(run, plots_dir)
    report = folder / REPORT
    report.write_text(run_markdown(run, plots, folder))
    return report, plots


def default_comparison_folder() -> Path:
    return Path("reports") / datetime.now().strftime("compare-%Y%m%d-%H%M%S")


def compare_runs(
    run_dirs: list[str], out: str | Path | None = None, overwrite: bool = False
) -> tuple[Path, list[Path]]:
    """One figure of the runs' loss and validation loss curves and a report.md with a table comparing
    them, in `out` (default: reports/compare-<timestamp>/). Returns (report.md, [the figure])."""
    runs = [load_run(path) for path in run_dirs]  # every run is checked before anything is written
    folder = _out_folder(
        out if out is not None else default_comparison_folder(), [r.path for r in runs], overwrite
    )
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
