"""Reports people look at: report.md and PNG plots of a run's metrics.jsonl (suite report, and the end
of every training run), and one figure comparing several runs' loss curves.

runs.py reads a run folder, plots.py draws (matplotlib, Agg), markdown.py writes the text, build.py
puts them in a folder. Imports nothing of suite but suite.config (its errors), suite.user_files (the
reader of files users hand in), suite.output_paths (the check that the report's folder can be written) and
suite.folders (what a report's own folder records)."""

from suite.report.build import compare_runs, report_at_end, report_run
from suite.report.runs import RunMetrics, load_run

__all__ = ["RunMetrics", "compare_runs", "load_run", "report_at_end", "report_run"]
