"""suite.report on metrics written by hand: which plots a run gets, what report.md says, that a report
never fails the run it describes; and the TensorBoard writer across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from suite.config.errors import ConfigError
from suite.config.schema import LogConfig
from suite.report import load_run, report_at_end, report_run
from suite.train.loggers import MetricsLogger, TensorBoardWriter


def write_run(folder: Path, steps: int = 8, mfu: float | None = 0.25, cut_last: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "val_loss": 9.0}]
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 9.0 - 0.5 * step, "lr": 1e-3 * step / steps, "grad_norm": 1.0}
        row |= {"tokens_per_s": 1000.0 + step, "mfu": mfu, "mem_gb": 0.5, "bad_steps": 0}
        if step % 4 == 0:
            row["val_loss"] = 9.1 - 0.5 * step
        rows.append(row)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 99, "lo' if cut_last else ""))
    (folder / "config.yaml").write_text("model:\n  name: gpt-tiny\n  num_layers: 2\ntrain:\n  max_steps: 8\n")
    return folder


def test_a_run_gets_report_md_and_a_plot_per_metric(tmp_path):
    run = write_run(tmp_path / "run", cut_last=True)
    report, plots = report_run(run)
    assert report == run / "report.md"
    assert [p.name for p in plots] == ["loss.png", "lr.png", "tokens_per_s.png", "mfu.png", "memory.png"]
    text = report.read_text()
    assert "| final train loss | 5.0000 |" in text  # step 8; the cut line after it is ignored
    assert "| best validation loss | 5.1000 (step 8) |" in text
    assert "| MFU (median) | 25.0% |" in text
    assert "| `model.name` | `gpt-tiny` |" in text


def test_no_peak_flops_means_no_mfu_plot_and_a_stale_one_goes(tmp_path):
    run = write_run(tmp_path / "run")
    report_run(run)
    assert (run / "plots" / "mfu.png").is_file()
    write_run(run, mfu=None)  # the same folder, rerun where no peak applies
    _, plots = report_run(run)
    assert "mfu.png" not in [p.name for p in plots] and not (run / "plots" / "mfu.png").exists()
    assert "MFU (median) | n/a" in (run / "report.md").read_text()


def test_load_run_refuses_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a run folder: it has no metrics.jsonl"):
        load_run(tmp_path)


def test_a_report_that_fails_is_a_warning_not_an_error(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")
    said: list[str] = []

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts\nsecond line")

    monkeypatch.setattr("suite.report.build.plot_run", broken)
    assert report_at_end(run, said.append) is None
    assert (
        len(said) == 1 and said[0].startswith("warning: no report.md") and "RuntimeError: no fonts" in said[0]
    )
    logger = MetricsLogger(run, {}, LogConfig(progress=False, wandb=False), 8, 0, resumed=True)
    logger.finish()  # the trainer's call: no exception escapes
    logger.close()
    assert not (run / "report.md").exists()


def test_tensorboard_resume_drops_the_steps_past_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "tensorboard"
    first = TensorBoardWriter(folder, resume_step=None)
    for step in range(1, 6):
        first.write({"step": step, "loss": float(step), "mfu": None, "note": "x"})
    first.close()
    resumed = TensorBoardWriter(folder, resume_step=3)  # the checkpoint was at step 3
    for step in range(4, 7):
        resumed.write({"step": step, "loss": 10.0 + step})
    resumed.close()
    events = EventAccumulator(str(folder))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert events.Tags()["scalars"] == ["loss"]  # None and text values are not scalars


def test_runs_compared_without_out_go_to_a_reports_folder_of_their_own(tmp_path, monkeypatch):
    from suite.report import compare_runs

    write_run(tmp_path / "a")
    write_run(tmp_path / "b", steps=4)
    monkeypatch.chdir(tmp_path)
    report, (figure,) = compare_runs(["a", "b"])
    assert report.parent.parent == Path("reports") and report.parent.name.startswith("compare-")
    assert figure == report.parent / "loss_comparison.png" and figure.is_file()
    table = [line for line in report.read_text().splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[2] for row in table] == ["8", "4"]  # steps of a, then b


def test_the_verb_takes_run_folders_and_out_only():
    from suite.cli.verbs.report import _parse

    assert _parse(["runs/a", "report.out=x", "runs/b"]) == (["runs/a", "runs/b"], "x")
    with pytest.raises(ConfigError, match="not 'train.max_steps=3'"):
        _parse(["runs/a", "train.max_steps=3"])
    with pytest.raises(ConfigError, match="at least one run folder"):
        _parse(["out=x"])
