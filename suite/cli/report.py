"""`suite report <run> [<run> ...] [out=DIR]`: one run's report.md + plots, or several runs compared."""

from __future__ import annotations

from suite.cli.common import _report
from suite.config.errors import ConfigError
from suite.folders import OVERWRITE

OUT_KEYS = ("out", "report.out")
EXAMPLE = "suite report runs/gpt-tiny (one run) or suite report runs/a runs/b out=reports/a-vs-b"


def _parse(args: list[str]) -> tuple[list[str], str | None]:
    """(run folders, out) from the verb's arguments: folders as typed, one optional out=DIR."""
    runs, out = [], None
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            runs.append(arg)
        elif key in OUT_KEYS and value.strip():
            out = value
        elif key in OUT_KEYS:
            raise ConfigError(f"{key} is empty; pass {key}=<a folder> for the report, or leave it out")
        else:
            raise ConfigError(f"suite report takes run folders and out=DIR, not '{arg}'; e.g. {EXAMPLE}")
    if not runs:
        raise ConfigError(f"suite report needs at least one run folder; e.g. {EXAMPLE}")
    return runs, out


def cmd_report(overrides: list[str], flags: set[str]) -> int:
    from suite.report import compare_runs, report_run

    runs, out = _parse(overrides)
    overwrite = OVERWRITE in flags  # out= holding something else: moved aside (suite.folders)
    if len(runs) == 1:
        report, plots = report_run(runs[0], out, overwrite)
    else:
        report, plots = compare_runs(runs, out, overwrite)
    names = ", ".join(p.name for p in plots)
    text = f"wrote {report} ({names} in {plots[0].parent}/)" if plots else f"wrote {report} (no plots)"
    return _report(flags, {"report": str(report), "plots": [str(p) for p in plots]}, text)
