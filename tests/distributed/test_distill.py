"""`suite distill`: a frozen teacher inside the step, under dp and FSDP exactly as in one process.

The teacher is a tiny GPT pretrained for a few steps by the CLI; the student has half its layers and
width. Real `suite distill` launches: dp=2 and sharding=2 (stage 3: the teacher is sharded too)
against one process, with the same checks as every layout (tests/helpers.py: assert_equivalent,
assert_layout). Bad input is one line before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import COMMON
from tests.helpers import TINY_MODEL, assert_equivalent, assert_layout, merged, run_suite, train_losses

STEPS = 4


STUDENT = merged(TINY_MODEL, ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4"])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("distill") / "teacher"
    run_suite(
        "pretrain", *TINY_MODEL, f"data.path={tiny_data}", f"run.dir={run}", "train.max_steps=6",
        "train.save_every=6", "train.eval_every=6", *COMMON[4:6], check=True,
    )  # fmt: skip
    return run


def distill(run: Path, teacher: Path, tiny_data: Path, *extra: str, check: bool = True):
    return run_suite(
        "distill", f"distill.teacher={teacher}", *merged(STUDENT, extra), f"data.path={tiny_data}",
        f"run.dir={run}", f"train.max_steps={STEPS}", f"train.save_every={STEPS}", f"train.eval_every={STEPS}",
        *COMMON, check=check,
    )  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory, teacher, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("distill") / "single"
    distill(run, teacher, tiny_data)
    return run


@pytest.mark.parametrize(
    "layout",
    [["parallel.dp=2"], ["parallel.sharding=2", "parallel.sharding_stage=3"]],
    ids=["dp2", "sharding2-stage3"],
)
def test_distill_layout_matches_single_process(tmp_path, teacher, tiny_data, single, layout):
    run = tmp_path / "run"
    distill(run, teacher, tiny_data, *layout, "launch.nproc_per_node=2")
    assert_layout(run, 2, [*TINY_MODEL, *layout])
    assert_equivalent(single, run)


def test_the_teacher_changes_the_loss(tmp_path, teacher, tiny_data, single):
    """ce_weight=1 is plain next-token training of the same student: its losses differ from the
    distilled run's from step 1 (the teacher term is really there), and match a plain pretrain run."""
    hard = tmp_path / "hard"
    distill(hard, teacher, tiny_data, "distill.ce_weight=1.0")
    plain = tmp_path / "plain"
    run_suite(
        "pretrain", *STUDENT, f"data.path={tiny_data}", f"run.dir={plain}",
        f"train.max_steps={STEPS}", f"train.save_every={STEPS}", f"train.eval_every={STEPS}", *COMMON, check=True,
    )  # fmt: skip
    got, want, mixed = train_losses(hard), train_losses(plain), train_losses(single)
    assert all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want), (got, want)
    assert abs(mixed[1] - want[1]) > 1e-3 * want[1], (mixed, want)


@pytest.mark.parametrize(
    "extra,words",
    [
        (["distill.teacher=null"], ["distill.teacher is missing"]),
        (["distill.teacher=/nope"], ["distill.teacher='/nope'"]),
        (["distill.loss=kl"], ["distill.loss='kl'", "forward_kl"]),
        (["distill.ce_weight=2"], ["distill.ce_weight=2"]),
        (["model.vocab_size=1024"], ["vocab_size=512", "vocab_size=1024"]),
        (["parallel.tp=2", "launch.nproc_per_node=2"], ["parallel.tp=2", "dp and sharding"]),
    ],
)
def test_bad_distill_input_is_one_line(tmp_path, teacher, tiny_data, extra, words):
    run = tmp_path / "bad"
    args = [a for a in extra if not a.startswith("distill.teacher=")]
    teacher_arg = next((a for a in extra if a.startswith("distill.teacher=")), f"distill.teacher={teacher}")
    proc = run_suite(
        "distill", teacher_arg, *merged(STUDENT, args), f"data.path={tiny_data}", f"run.dir={run}"
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not run.exists()


def test_distill_on_chat_rows_matches_single_process_at_dp2(tmp_path, tiny_data):
    """distill.data=sft: a student from scratch on a task's chat rows (the teacher's tokenizer and chat
    template), the loss only on assistant tokens; dp=2 equals one process."""
    from tests.e2e.test_finetune import TINY_FT, tiny_base

    base = tiny_base(tmp_path / "teacher-hf", tiny_data)
    rows = merged(
        [o for o in TINY_FT if not o.startswith("finetune.eval_samples")],
        ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=512"],
        [
            "model.max_seq_len=64",
            "finetune.eval_samples=0",
            "sched.warmup_steps=1",
            "train.save_grads_step=1",
        ],
    )

    def run(name: str, *extra: str) -> Path:
        out = tmp_path / name
        run_suite(
            "distill", "recipe=distill-sft-tiny", f"distill.teacher=hf:{base}", f"run.dir={out}", *rows, *extra,
            check=True,
        )  # fmt: skip
        return out

    single = run("single")
    assert_equivalent(single, run("dp2", "parallel.dp=2", "launch.nproc_per_node=2"))


def test_a_teacher_with_another_tokenizer_is_one_line(tmp_path, teacher, tiny_data):
    """Same vocabulary size, other ids: data prepared from other text gets a tokenizer of its own."""
    from suite.config.schema import DataConfig, DataSourceConfig
    from suite.data import prepare

    text = tmp_path / "other.jsonl"
    text.write_text(
        "".join(f'{{"text": "Record {i}: zebra quartz {i * 37 % 101} vortex jungle."}}\n' for i in range(600))
    )
    other = prepare(
        DataConfig(sources=[DataSourceConfig(path=str(text))], vocab_size=512, val_fraction=0.2),
        tmp_path / "other",
        progress=False,
    )
    run = tmp_path / "bad"
    proc = distill(run, teacher, other, "data.seq_len=32", "model.max_seq_len=32", check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(err.splitlines()) == 1 and "another tokenizer" in err and "data.tokenizer=" in err, err
