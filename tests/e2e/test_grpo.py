"""`suite align align.method=grpo` as a user runs it, on a tiny random GPT (tests/e2e/test_finetune.py's
base) and a small addition task, rewarded by tests/grpo_aids.py:length (a random model's answers are
never right, but their lengths vary, so every step has advantages and gradients).

One 20-step single-process run is shared (a tiny GPT whose weights are scaled up, `base`): the sampler's log-probabilities equal the trainer's at every
step, the dp=2 run equals it, and so do the resumed steps of a killed run and of a killed `suite run`
pipeline's GRPO stage. Two more launches stop at their first step or before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.grpo_aids import PAUSE_ENV
from tests.helpers import REPO, assert_equivalent, assert_layout, read_metrics, run_suite, suite_env

STEPS = 20
GRPO = [
    "align.method=grpo",
    "log.wandb=false",
    "log.progress=false",
    "log.report=false",
    "data.seq_len=64",
    "finetune.data.task=addition-2",
    "finetune.data.num_train=32",
    "finetune.data.num_eval=4",
    "finetune.eval_samples=0",
    "align.grpo.group_size=4",
    "align.grpo.prompts_per_step=2",
    "align.grpo.max_new_tokens=4",
    "align.grpo.reward=tests.grpo_aids:length",
    f"train.max_steps={STEPS}",
    f"train.eval_every={STEPS}",
    f"train.save_every={STEPS}",
    "train.log_every=1",
    "train.save_grads_step=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
    "optim.lr=3e-3",
    "sched.warmup_steps=1",
    "train.precision=fp32",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    """tests/e2e/test_finetune.py's tiny GPT with every weight x4: peaked distributions, whose
    log-probabilities a KV-cache sampler gets ~1e-6 apart from the trainer's (the seeded init's
    near-uniform ones agree to ~1e-7 whatever the sampler does, and would test nothing)."""
    from suite.config.schema import ModelConfig
    from suite.data import load_tokenizer
    from suite.export.hf import export_hf
    from suite.models import build_model, materialize

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64)
    model = materialize(build_model(cfg), "cpu", seed=7)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4)
    return export_hf(model, cfg, tmp_path_factory.mktemp("grpo") / "base-hf", load_tokenizer(tiny_data))


def grpo(run_dir: Path, base: Path, *extra: str, env: dict | None = None, check: bool = True):
    return run_suite(
        "align", f"model.init_from=hf:{base}", f"run.dir={run_dir}", *GRPO, *extra, env=env, check=check
    )


@pytest.fixture(scope="module")
def single(tmp_path_factory, base) -> Path:
    run = tmp_path_factory.mktemp("grpo") / "single"
    grpo(run, base)
    return run


def steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def test_sampler_and_trainer_logprobs_agree_at_every_step(single):
    rows = steps(single)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["logprob_diff_max"] <= 1e-6 for r in rows), [r["logprob_diff_max"] for r in rows]
    assert len({r["reward"] for r in rows}) > 1 and any(r["grad_norm"] > 0 for r in rows)


def test_dp2_matches_single_process(tmp_path, base, single):
    """Each rank samples its half of the prompts with the generators one process uses for them: the
    same rollouts, rewards and token-level loss, so losses, gradient norms, step-1 gradients and updates
    equal one process's."""
    overrides = ["parallel.dp=2"]
    run = tmp_path / "dp2"
    grpo(run, base, *overrides, "launch.nproc_per_node=2")
    assert_layout(run, 2, overrides)
    assert [r["reward"] for r in steps(run)] == [r["reward"] for r in steps(single)]
    # the key biases' gradient is rounding noise (softmax ignores a per-query constant): ~5e-8 here, above
    # AdamW's eps, so each of the 20 steps moves them by up to ~lr in a direction the noise picks, and
    # that differs by layout (measured 9e-4); every other parameter's update is compared at 1e-4
    assert_equivalent(single, run, noise_atol=3e-3)


def test_a_sampler_that_disagrees_with_the_trainer_stops_in_one_line(tmp_path, base):
    aids = os.pathsep.join([suite_env()["SUITE_TEST_COMPONENTS"], str(REPO / "tests" / "grpo_aids.py")])
    proc = grpo(tmp_path / "bad", base, env=suite_env(SUITE_TEST_COMPONENTS=aids), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "align.grpo.max_abs_logprob_diff=0.0001" in line and "at step 1" in line, proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_completion_per_prompt_is_refused_in_one_line(tmp_path, base):
    proc = grpo(tmp_path / "g1", base, "align.grpo.group_size=1", check=False)
    assert proc.returncode == 2 and not (tmp_path / "g1").exists(), proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]
    assert "align.grpo.group_size=1" in proc.stderr and "align.grpo.group_size=8" in proc.stderr


def test_a_killed_run_resumes_with_the_rollouts_of_the_uninterrupted_one(tmp_path, base, single):
    """SIGKILLed before step 8, resumed from step 6's checkpoint: the loader's position and the weights
    are restored and the generators are a function of the prompt's number, so steps 7-20 sample the
    same completions (the same rewards) and take the same losses as the run that was never stopped."""
    run, every = tmp_path / "killed", "train.save_every=3"
    killed = grpo(run, base, every, "train.fault_kill_rank=0", "train.fault_kill_step=8", check=False)
    assert killed.returncode != 0 and (run / "checkpoints" / "step_6").is_dir(), killed.stderr
    grpo(run, base, every)
    resumed = {r["step"]: r for r in steps(run)}  # a step logged twice: the resumed run's row, last
    for want in steps(single)[6:]:
        got = resumed[want["step"]]
        assert got["reward"] == want["reward"], (want["step"], got["reward"], want["reward"])
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * max(1.0, abs(want["loss"])), want["step"]


def test_a_dp2_run_killed_between_two_updates_of_one_rollout_batch_resumes_on_each_ranks_own(tmp_path, base):
    """Two updates per rollout batch at dp=2, the checkpoint at step 3 (between rollout batch 2's two
    updates), killed before step 6: the resumed step 4 trains each rank on the groups that rank sampled
    (restored from the checkpoint, which holds every rank's), so steps 4 and 5 log the losses and rewards
    the killed run logged. Fails if the checkpoint keeps only rank 0's groups (rank 1 would train on
    rank 0's prompts: another loss) or if step 4 samples anew with the updated policy."""
    run = tmp_path / "dp2-killed"
    extra = [
        "parallel.dp=2",
        "launch.nproc_per_node=2",
        "align.grpo.updates_per_batch=2",
        "train.max_steps=6",
    ]
    killed = grpo(run, base, *extra, "train.save_every=3", "train.fault_kill_rank=0",
                  "train.fault_kill_step=6", check=False)  # fmt: skip
    assert killed.returncode != 0 and (run / "checkpoints" / "step_3").is_dir(), killed.stderr
    before = {r["step"]: r for r in steps(run)}
    assert sorted(before) == [1, 2, 3, 4, 5], sorted(before)
    resumed = grpo(run, base, *extra, "train.save_every=3")
    assert "step 3" in resumed.stdout + resumed.stderr, resumed.stdout  # where it resumed from
    after = {r["step"]: r for r in steps(run)}  # a step logged twice: the resumed run's row, last
    assert sorted(after) == [1, 2, 3, 4, 5, 6], sorted(after)
    assert after[5]["reward"] == before[5]["reward"]  # step 5 samples rollout batch 3 (step 4: no new one)
    # step 4 trains on the checkpointed rollout batch 2: it logs that batch's figures, as the killed run did
    for key in ("reward", "completion_tokens", "logprob_diff_max"):
        assert after[4].get(key) == before[4][key], (key, after[4], before[4])
    for step in (4, 5):
        assert abs(after[step]["loss"] - before[step]["loss"]) <= 1e-6 * max(
            1.0, abs(before[step]["loss"])
        ), step


def test_a_killed_pipeline_grpo_stage_resumes_with_the_uninterrupted_runs_rewards(tmp_path, base, single):
    """`suite run` of a pipeline whose stage is GRPO, SIGKILLed from outside (its process group) after
    the stage wrote its step-6 checkpoint and before it finished (the reward holds the run there:
    tests/grpo_aids.py), then the same command again: the stage resumes from step 6, steps 7-20 sample
    the completions of the run that was never stopped (the same rewards), and the report is written.
    Fails if the rerun starts the stage afresh, or if the rollout generators or the loader's position
    are not restored (other prompts or completions: other rewards)."""
    args = [f"model.init_from=hf:{base}", *GRPO, "train.save_every=3"]
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"stages:\n  grpo:\n    verb: align\n    args: {json.dumps(args)}\n")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "suite", "run", f"pipeline={recipe}", f"run.dir={out}"]
    checkpoints, held = out / "grpo" / "checkpoints", tmp_path / "held"
    env = suite_env(**{PAUSE_ENV: f"{checkpoints / 'step_6' / 'manifest.json'}|{held}"})
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not held.exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate()
    assert held.exists(), stderr[-3000:]
    saved = sorted(int(p.parent.name[5:]) for p in checkpoints.glob("step_*/manifest.json"))
    assert saved == [3, 6], saved  # held before step 9's save: step 6 is the newest checkpoint
    done = subprocess.run(command, cwd=REPO, env=suite_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_6'} at step 6" in done.stdout, done.stdout[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "pipeline.json").read_text())["stages"]}
    assert stages["grpo"]["action"] == "resumed" and stages["grpo"]["status"] == "done", stages
    assert "| grpo | align | resumed" in (out / "report.md").read_text()
    resumed = {r["step"]: r for r in steps(out / "grpo")}  # a step logged twice: the resumed run's row, last
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s]["reward"] for s in range(7, STEPS + 1)] == [r["reward"] for r in steps(single)[6:]]
