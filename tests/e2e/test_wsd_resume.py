"""sched=wsd through the real CLI: a run stopped in its stable phase and resumed with a larger
train.max_steps continues bitwise like a run that had the larger max_steps from the start."""

from __future__ import annotations

import shutil

from tests.helpers import TINY_MODEL, run_suite, train_losses


def _args(run_dir, data, max_steps: int) -> list[str]:
    return [
        "pretrain",
        *TINY_MODEL,
        f"data.path={data}",
        f"run.dir={run_dir}",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.eval_batches=1",
        "train.save_every=4",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        "optim.lr=3e-3",
        "sched=wsd",
        "sched.warmup_steps=1",
        "sched.decay_fraction=0.25",
        f"train.max_steps={max_steps}",
    ]


def test_raising_max_steps_in_the_stable_phase_continues_bitwise(tmp_path, tiny_data):
    """Fails if the decay start were kept from the first run's length (a saved scheduler state, or
    max_steps in the run's identity refusing the resume), or if resume lost any state: the resumed
    steps would then differ from the long run's."""
    short, branch, long = tmp_path / "short", tmp_path / "branch", tmp_path / "long"
    run_suite(*_args(short, tiny_data, 8), check=True)  # decays at steps 7-8 (lr)
    run_suite(*_args(long, tiny_data, 12), check=True)  # decays at steps 10-12
    # the short run as if stopped at its stable-phase checkpoint (step 4), then extended to 12 steps
    shutil.copytree(short, branch)
    shutil.rmtree(branch / "checkpoints" / "step_8")
    (branch / "checkpoints" / "latest").write_text("step_4\n")
    resumed = run_suite(*_args(branch, tiny_data, 12), check=True)
    assert "at step 4" in resumed.stdout, resumed.stdout
    a, b, c = train_losses(short), train_losses(branch), train_losses(long)
    # a step's loss is computed before its update: the short run's first decayed update (step 7) shows at 8
    assert [a[s] for s in range(1, 8)] == [c[s] for s in range(1, 8)]
    assert a[8] != c[8]
    assert [b[s] for s in range(5, 13)] == [c[s] for s in range(5, 13)]  # the decay moved, bitwise
