"""Reports: every finished training run holds report.md + plots; `suite report` draws one run's report
after the fact or one figure comparing runs; log=tensorboard writes the same scalars as metrics.jsonl;
wandb keeps the report as an artifact; folders that are not runs are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import TINY_MODEL, read_metrics, run_suite

STEPS = 6
FAST = [
    f"train.max_steps={STEPS}",
    f"train.save_every={STEPS}",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.compile=false",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
    "log.report=true",  # what these tests are about (TINY_MODEL turns it off)
]
PANELS = ["loss.png", "lr.png", "tokens_per_s.png", "mfu.png", "memory.png"]


def pretrain(run_dir: Path, data: Path, *extra: str) -> Path:
    proc = run_suite("pretrain", f"data.path={data}", f"run.dir={run_dir}", *TINY_MODEL, *FAST, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {run_dir}/report.md" in proc.stdout, proc.stdout
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> tuple[Path, Path]:
    """Two tiny pretraining runs: one logging to TensorBoard, one to wandb (offline), another lr."""
    root = tmp_path_factory.mktemp("report-runs")
    first = pretrain(root / "tb", tiny_data, "log=tensorboard", "log.wandb=false")
    second = pretrain(root / "wb", tiny_data, "log.wandb=true", "optim.lr=0.0005")
    return first, second


def assert_picture(path: Path, width: int, height: int) -> None:
    """A PNG of `width` x `height` pixels with something drawn in it (not one flat colour)."""
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.shape[:2] == (height, width), (path, pixels.shape)
    assert pixels.var() > 0, path
    colours = {tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
    assert len(colours) > 10, (path, len(colours))  # axes, text, lines: many shades, not a blank page


def test_a_finished_run_has_report_md_and_its_plots(runs):
    for run in runs:
        report = (run / "report.md").read_text()
        for name in PANELS:
            assert_picture(run / "plots" / name, 800, 450)
            assert f"](plots/{name})" in report, name
        last = read_metrics(run)[-1]
        assert f"| final train loss | {last['loss']:.4f} |" in report
        assert f"| final validation loss | {last['val_loss']:.4f} |" in report
        assert "| `model.num_layers` | `2` |" in report


def test_suite_report_compares_two_runs_in_one_figure(runs, tmp_path):
    out = tmp_path / "cmp"
    proc = run_suite("report", *map(str, runs), f"out={out}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}/report.md" in proc.stdout
    # made_by.json: the runs it compares (suite/folders.py)
    assert sorted(p.name for p in out.iterdir()) == ["loss_comparison.png", "made_by.json", "report.md"]
    assert_picture(out / "loss_comparison.png", 1600, 450)
    report = (out / "report.md").read_text()
    assert "![Loss and validation loss](loss_comparison.png)" in report
    for run in runs:
        last = read_metrics(run)[-1]
        row = next(line for line in report.splitlines() if line.startswith(f"| `{run}` |"))
        assert f"| {STEPS} | {last['loss']:.4f} | {last['val_loss']:.4f} |" in row, row


def test_suite_report_redraws_one_run_elsewhere(runs, tmp_path):
    out = tmp_path / "one"
    proc = run_suite("report", str(runs[0]), f"out={out}", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["report"] == str(out / "report.md")
    assert [Path(p).name for p in result["plots"]] == PANELS
    assert (out / "report.md").read_text().startswith(f"# Run report: {runs[0]}")


def test_tensorboard_holds_the_logged_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = runs[0] / "tensorboard"
    events = EventAccumulator(str(folder))
    events.Reload()
    metrics = read_metrics(runs[0])
    for key in ("loss", "val_loss", "lr", "tokens_per_s", "mem_gb"):
        want = {r["step"]: r[key] for r in metrics if r.get(key) is not None}
        got = {e.step: e.value for e in events.Scalars(key)}
        assert sorted(got) == sorted(want), key
        assert all(abs(got[s] - want[s]) <= 1e-5 * max(1.0, abs(want[s])) for s in want), key
    assert sorted(got) == list(range(1, STEPS + 1))  # mem_gb: every logged step
    assert not (runs[0] / "wandb").exists()  # log=tensorboard: instead of wandb


def test_wandb_keeps_the_report_as_an_artifact(runs):
    run = runs[1]
    run_id = (run / ".wandb_id").read_text().strip()
    (log,) = (run / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
    data = log.read_bytes()
    assert f"report-{run_id}".encode() in data  # the artifact, queued for `wandb sync`
    assert b"plots/loss.png" in data and b"report.md" in data


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "does not exist"),
        ("empty_dir", "is not a run folder: it has no metrics.jsonl"),
        ("no_metrics", "is a run folder without metrics.jsonl"),
        ("empty_metrics", "has no metrics yet"),
        ("a_file", "is a file, not a run folder"),
    ],
)
def test_report_refuses_what_is_not_a_run_in_one_line(tmp_path, runs, case, expected):
    target = tmp_path / case
    if case == "empty_dir":
        target.mkdir()
    elif case == "no_metrics":
        target.mkdir()
        (target / "config.yaml").write_text((runs[0] / "config.yaml").read_text())
    elif case == "empty_metrics":
        target.mkdir()
        (target / "metrics.jsonl").write_text('{"step": 1, "lo')  # a cut line, nothing whole
    elif case == "a_file":
        target.write_text("not a run\n")
    out = tmp_path / "out"
    proc = run_suite("report", str(runs[0]), str(target), f"out={out}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: suite report: "), proc.stderr
    assert expected in lines[0] and str(target) in lines[0], lines[0]
    assert not out.exists()  # every run is checked before anything is written
