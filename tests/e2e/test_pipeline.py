"""`suite run pipeline=...`: a tiny pipeline (pretrain, finetune, quantize, export, eval) written by
the test, run through the real CLI: the report, skipping on rerun, resuming a killed finetuning
stage, gates, --only / --from, and bad input in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY_MODEL, child_processes, fork_servers, process_gone, run_suite, suite_env

pytestmark = pytest.mark.slow

TRAIN = [
    "train.log_every=1",
    "train.compile=false",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
]
FT = [
    "recipe=sft-tiny",
    "data.seq_len=64",
    "finetune.data.task=reverse-3",
    "finetune.data.num_train=48",
    "finetune.data.num_eval=8",
    "finetune.eval_samples=2",
    "train.precision=fp32",
    "log.wandb=false",
    "log.progress=false",
]
REPORT = ["compress.eval_batches=1", "compress.decode_tokens=4", "compress.task_samples=4"]


def write_recipe(folder: Path, tiny_data: Path, ft_steps: int = 4, gate: str = "max_drop: 1.0") -> Path:
    def args(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(a) for a in items) + "]"

    pretrain = [f"data.path={tiny_data}", *TINY_MODEL, *TRAIN, "train.max_steps=4", "train.save_every=2"]
    sft = [
        "model.init_from=${stage:pretrain}",
        *FT,
        *TRAIN,
        f"train.max_steps={ft_steps}",
        "train.save_every=2",
    ]
    text = f"""# A tiny pipeline for tests.
#   suite run pipeline={folder}/tiny.yaml
stages:
  pretrain:
    args: {args(pretrain)}
  sft:
    verb: finetune
    args: {args(sft)}
  int8:
    verb: quantize
    args: {args(["ckpt=${stage:sft}", "compress=int8", *REPORT])}
  export-hf:
    verb: export
    args: {args(["ckpt=${stage:sft}"])}
  eval-sft:
    verb: eval
    args: {args(["ckpt=${stage:sft}", "eval.num_samples=4"])}
  eval-int8:
    verb: eval
    args: {args(["ckpt=${stage:int8}", "eval.num_samples=4"])}
  eval-hf:
    verb: eval
    args: {args(["ckpt=hf:${stage:export-hf}", "task=reverse-3", "eval.num_samples=4"])}
gates:
  - {{metric: accuracy, of: int8, vs: sft, {gate}}}
"""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.yaml"
    path.write_text(text)
    return path


def record(folder: Path) -> dict[str, dict]:
    data = json.loads((folder / "pipeline.json").read_text())
    return {s["name"]: s for s in data["stages"]}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("pipeline")
    recipe = write_recipe(root, tiny_data)
    out = root / "run"
    proc = run_suite("run", f"pipeline={recipe}", f"run.dir={out}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return root, recipe, out, proc


def test_pipeline_runs_every_stage_and_writes_the_report(finished):
    _, _, out, proc = finished
    stages = record(out)
    assert all(s["status"] == "done" and s["action"] == "ran" for s in stages.values()), stages
    assert "==> [1/7] pretrain: suite pretrain" in proc.stdout
    data = json.loads((out / "pipeline.json").read_text())
    assert data["status"] == "done" and data["gates"][0]["passed"]
    figures = data["figures"]
    assert 0 <= figures["sft"]["accuracy"] <= 1 and figures["int8"]["bytes"] > 0
    assert figures["sft"]["params"] > 0 and figures["export-hf"]["bytes"] > 0
    assert "accuracy" in figures["export-hf"]  # the HF folder, evaluated through transformers
    text = (out / "report.md").read_text()
    assert "| sft | finetune | ran" in text and "report.png" in text
    from PIL import Image

    image = Image.open(out / "report.png").convert("L")
    assert image.size[0] > 400
    assert sum(1 for count in image.histogram() if count) > 20  # bars, labels, axes: not a blank canvas


def test_rerun_skips_finished_stages(finished):
    _, recipe, out, _ = finished
    proc = run_suite("run", f"pipeline={recipe}", f"run.dir={out}", check=True)
    assert {s["action"] for s in record(out).values()} == {"skipped"}
    assert "pretrain: finished earlier (step 4," in proc.stdout


def test_only_and_from_rerun_part_of_it(finished):
    _, recipe, out, _ = finished
    run_suite("run", f"pipeline={recipe}", f"run.dir={out}", "--only", "eval-int8", check=True)
    actions = {n: s["action"] for n, s in record(out).items()}
    assert actions.pop("eval-int8") == "ran" and set(actions.values()) == {"kept"}
    run_suite("run", f"pipeline={recipe}", f"run.dir={out}", "--from", "export-hf", check=True)
    actions = {n: s["action"] for n, s in record(out).items()}
    assert actions == {
        "pretrain": "kept",
        "sft": "kept",
        "int8": "kept",
        "export-hf": "ran",
        "eval-sft": "ran",
        "eval-int8": "ran",
        "eval-hf": "ran",
    }


def test_a_failing_gate_stops_the_pipeline_in_one_line(finished, tiny_data):
    root, _, out, _ = finished
    strict = write_recipe(root / "strict", tiny_data, gate="min: 1.01")  # same stages: all skipped
    proc = run_suite("run", f"pipeline={strict}", f"run.dir={out}")
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "gate 'accuracy int8 vs sft': accuracy of int8 is" in errors[0] and "(min 1.01)" in errors[0]
    assert "not run: eval-hf" in errors[0]  # eval-int8 gave int8's accuracy: the gate was checked there
    assert json.loads((out / "pipeline.json").read_text())["status"] == "stopped by a gate"


def test_killed_during_finetuning_resumes_it(tmp_path, tiny_data):
    """SIGKILL to the whole `suite run` (its process group) while finetuning. The stage is a process
    forked by the run's fork server (suite/launch/fork_server.py; no GPU here), standing behind a client
    in the run's group: the test asserts that process tree, and that the stage dies with the run."""
    recipe = write_recipe(tmp_path, tiny_data, ft_steps=400)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "suite", "run", f"pipeline={recipe}", f"run.dir={out}"]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=suite_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoints = out / "sft" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(checkpoints.glob("step_*/manifest.json")):
            break
        time.sleep(0.05)
    tree = child_processes(proc.pid)
    servers = fork_servers(proc.pid)
    clients = [pid for pid, cmd in tree.items() if b"--client\0suite.cli\0finetune" in cmd]
    forked = child_processes(servers[0]) if servers else {}
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(servers) == 1 and len(clients) == 1 and len(forked) == 1, (tree, forked)
    deadline = time.time() + 30
    while time.time() < deadline and not all(process_gone(pid) for pid in [*forked, *servers]):
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in [*forked, *servers]), "the forked stage outlived its run"
    steps = sorted(int(p.parent.name[5:]) for p in checkpoints.glob("step_*/manifest.json"))
    assert steps and steps[-1] < 400, steps
    step = steps[-1]
    done = run_suite("run", f"pipeline={recipe}", f"run.dir={out}", f"sft.train.max_steps={step + 2}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step_{step}'} at step {step}" in done.stdout
    stages = record(out)
    assert stages["pretrain"]["action"] == "skipped" and stages["sft"]["action"] == "resumed"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["pipeline=no-such-pipeline"],
            "pipeline='no-such-pipeline' is not a known pipeline; known: align, embedded",
        ),
        ([], "pipeline is missing"),
        (
            ["pipeline=embedded", "--from", "pretrian"],
            "--from: 'pretrian' is not a stage of pipeline 'embedded'",
        ),
        (["pipeline=embedded", "--only", "x"], "--only: 'x' is not a stage"),
        (["pipeline=embedded", "nosuch.train.max_steps=3"], "'nosuch' is not a stage of pipeline 'embedded'"),
        (["pipeline=embedded", "steps=3"], "steps=3 is not a key of suite run"),
        (["pipeline={bad_ref}"], "${stage:pretrian} is not an earlier stage; it can read: pretrain"),
        (["pipeline={sets_dir}"], "stage 'pretrain' sets run.dir; the pipeline gives every stage its folder"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, expected):
    bad_ref = tmp_path / "bad_ref.yaml"
    bad_ref.write_text(
        "stages:\n  pretrain: {args: []}\n  sft: {verb: finetune, args: ['model.init_from=${stage:pretrian}']}\n"
    )
    sets_dir = tmp_path / "sets_dir.yaml"
    sets_dir.write_text("stages:\n  pretrain: {args: [run.dir=elsewhere]}\n")
    argv = [a.format(bad_ref=bad_ref, sets_dir=sets_dir) for a in args]
    proc = run_suite("run", *argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()
