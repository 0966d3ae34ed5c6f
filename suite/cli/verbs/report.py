"""`suite report`: one run's report.md and plots, or one figure comparing several runs."""

from __future__ import annotations

from suite.cli.common import _report
from suite.config.errors import ConfigError
from suite.folders import OVERWRITE
from suite.verb import Verb, register

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
            raise ConfigError(
                f"{key} is empty; drop {key}= for the default folder (the run's own, or a new one in "
                "reports/ for several runs)"
            )
        else:
            raise ConfigError(f"suite report takes run folders and out=DIR, not '{arg}'; e.g. {EXAMPLE}")
    if not runs:
        raise ConfigError(f"suite report needs at least one run folder; e.g. {EXAMPLE}")
    return runs, out


def run(overrides: list[str], flags: set[str]) -> int:
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
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


HELP = """usage: suite report <run.dir> [<run.dir> ...] [out=DIR] [--json]

Reads each run folder's metrics.jsonl (and config.yaml) and draws PNG plots with matplotlib.
Every training run (pretrain, finetune, distill) writes its report when it ends (log.report=true);
`suite report` draws it again, e.g. for a run that was stopped or resumed.

One run: <run.dir>/report.md (final and best losses, median tokens/s and MFU, peak memory, the
settings that shaped the run) and <run.dir>/plots/: loss.png (loss and val_loss), lr.png,
tokens_per_s.png, mfu.png (where a peak FLOP/s applies), memory.png. out=DIR writes them to DIR.

Several runs: one figure, loss_comparison.png (training loss and validation loss, a line per run,
by step), and a report.md with a table comparing the runs, in out=DIR (default
reports/compare-<timestamp>/). A folder that is not a training run, or has no metrics yet, is
refused in one line before anything is written.

Examples:
  suite report runs/gpt-tiny
  suite pretrain recipe=llama-tiny
  suite report runs/gpt-tiny runs/llama-tiny out=reports/gpt-vs-llama"""


VERB = register(
    Verb(
        name="report",
        summary="report.md + plots of a run, or one figure comparing runs: suite report runs/a runs/b out=reports/a-vs-b",
        help=HELP,
        run=run,
        section="tools",
        flags=(OVERWRITE,),
    )
)
