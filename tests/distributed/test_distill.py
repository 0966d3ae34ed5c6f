"""`suite distill`: a frozen teacher inside the step, under dp, FSDP and tp exactly as in one process.

The teacher is a tiny GPT pretrained for a few steps by the CLI; the student has half its layers and
width. Real `suite distill` launches: dp=2 and sharding=2 (stage 3: the teacher is sharded too),
tp=2 with and without sp and dp2 x tp2 (the teacher split by the same tp plans, the loss over
vocabulary-sharded heads), an MoE student at tp=2, against one process, with the same checks as
every layout (tests/helpers.py: assert_equivalent, assert_layout). Bad input is one line before
anything starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.conftest import COMMON
from tests.helpers import (
    TINY_MODEL,
    assert_equivalent,
    assert_layout,
    export_and_compare,
    merged,
    read_metrics,
    run_suite,
    train_losses,
)

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
    steps = [f"train.max_steps={STEPS}", f"train.save_every={STEPS}", f"train.eval_every={STEPS}"]
    return run_suite(
        "distill", f"distill.teacher={teacher}", f"data.path={tiny_data}", f"run.dir={run}",
        *merged(STUDENT, steps, COMMON, list(extra)), check=check,
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


# student width 32, teacher 64: projected; the linear schedule makes a resumed run's weights step-dependent
HIDDEN = ["distill.hidden_weight=1.0", "distill.hidden_schedule=linear", "train.save_every=2"]


@pytest.fixture(scope="module")
def hidden_single(tmp_path_factory, teacher, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("distill") / "hidden-single"
    distill(run, teacher, tiny_data, *HIDDEN)
    return run


def test_hidden_matching_under_fsdp_and_resumed_equals_one_process(
    tmp_path, teacher, tiny_data, hidden_single
):
    """distill.hidden_weight: the learned projections train (their step-1 gradients compared too) and
    shard with FSDP's root as in one process; a run resumed from step 2 continues exactly; the
    checkpoints hold the projections, the weights a run is read as (eval, export) do not."""
    from torch.distributed.checkpoint import FileSystemReader

    from suite.model_source import ModelSource

    one = hidden_single
    sharded = tmp_path / "sharded"
    layout = ["parallel.sharding=2", "parallel.sharding_stage=3"]
    distill(sharded, teacher, tiny_data, *HIDDEN, *layout, "launch.nproc_per_node=2")
    assert_layout(sharded, 2, [*TINY_MODEL, *layout])
    assert_equivalent(one, sharded)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    distill(resumed, teacher, tiny_data, *HIDDEN)
    want = {s: v for s, v in train_losses(one).items() if s > 2}
    assert train_losses(resumed) == want, (train_losses(resumed), want)
    saved = FileSystemReader(str(one / "checkpoints" / f"step_{STEPS}")).read_metadata().state_dict_metadata
    assert "model.distill_proj.0.weight" in saved  # one student block, one projection
    # a student that starts from a checkpoint (a pruned model) of another width than the teacher's:
    # its projections are new, not read from the checkpoint
    from_ckpt = tmp_path / "from-ckpt"
    distill(from_ckpt, teacher, tiny_data, *HIDDEN, f"model.init_from={one}")
    assert sorted(train_losses(from_ckpt)) == list(range(1, STEPS + 1))
    constant = tmp_path / "constant"
    distill(constant, teacher, tiny_data, *HIDDEN, "distill.hidden_schedule=constant")
    steady = train_losses(constant)  # the same first step (weight 1.0), then the decay shows
    assert steady[1] == train_losses(one)[1] and steady[STEPS] != train_losses(one)[STEPS], steady
    with ModelSource.parse(str(one), "ckpt").weights() as weights:
        assert weights and not any(name.startswith("distill_proj") for name in weights)
    assert abs(export_and_compare(one, tmp_path / "hf")) < 1e-4


@pytest.mark.parametrize(
    "extra,words",
    [
        (["distill.teacher=null"], ["distill.teacher is missing"]),
        (["distill.teacher=/nope"], ["distill.teacher='/nope'"]),
        (["distill.loss=kl"], ["distill.loss='kl'", "forward_kl"]),
        (["distill.ce_weight=2"], ["distill.ce_weight=2"]),
        (["distill.hidden_loss=l1"], ["distill.hidden_loss='l1'", "cosine"]),
        (["distill.hidden_weight=-1"], ["distill.hidden_weight=-1"]),
        (["distill.hidden_schedule=cosine"], ["distill.hidden_schedule='cosine'", "linear"]),
        (["model.vocab_size=1024"], ["vocab_size=512", "vocab_size=1024"]),
        (
            ["parallel.pp=2", "model.num_layers=2", "launch.nproc_per_node=2", "distill.hidden_weight=1.0"],
            ["parallel.pp=2", "tp (+sp)"],
        ),
        # the teacher (4 heads) is split like the student (8 heads): tp must divide both
        (["model.num_heads=8", "parallel.tp=8", "launch.nproc_per_node=8"], ["teacher's model.num_heads=4"]),
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
    template), the loss only on assistant tokens, with the recipe's hidden-state matching (student
    width 32, teacher 64: learned projections); dp=2 equals one process."""
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


# Tensor parallelism: the student's and the teacher's heads vocabulary-sharded (suite.distill.vocab_parallel).
# Two launches cover the layouts (each costs ~30 s on 2 cores): tp=2 with sp and hidden-state matching
# (learned projections, Replicated on the tp ranks) for a dense student, dp2 x tp2 without sp for an
# MoE student (expert tensor parallel; jsd at T=2).
TP_LAYOUT = ["parallel.tp=2", "parallel.sp=true"]


def test_distill_at_tp2_with_sp_and_hidden_matching_matches_single_process(
    tmp_path, teacher, tiny_data, hidden_single
):
    run = tmp_path / "tp2-sp"
    distill(run, teacher, tiny_data, *HIDDEN, *TP_LAYOUT, "launch.nproc_per_node=2")
    got = assert_layout(run, 2, [*TINY_MODEL, *TP_LAYOUT])
    for view in got["ranks"]:  # the projections are tp-replicated DTensors, trained like the rest
        assert view["params"]["distill_proj.0.weight"] == "tp:Replicate()", view["params"]
    assert_equivalent(hidden_single, run)


PP_LAYOUT = ["model.num_layers=2", "parallel.pp=2", "parallel.pp_schedule=1f1b"]


def test_distill_at_pp2_1f1b_matches_single_process(tmp_path, teacher, tiny_data):
    """A 2-layer student split into 2 pipeline stages (1f1b, 4 micro-batches a step) equals one process:
    the distillation loss runs on the last stage, where the step hands it the tokens of the micro-batch
    the schedule is at, and the whole teacher there turns them into its logits.

    Wrong code this catches: the loss finding the wrong micro-batch's tokens (e.g. a counter that the
    schedule's shape-inference pass advances, or always the first micro-batch: the teacher's logits then
    belong to other rows and step 1's loss, norm and gradients move); the pipeline schedule's loss
    weighting the distillation term per micro-batch rather than over the global batch (gradients off by
    the micro-batch count); the student's MoE/aux handling adding the aux loss twice on the last stage."""
    single, pp = tmp_path / "single", tmp_path / "pp2"
    distill(single, teacher, tiny_data, "model.num_layers=2")
    distill(pp, teacher, tiny_data, *PP_LAYOUT, "launch.nproc_per_node=2")
    assert_layout(pp, 2, [*TINY_MODEL, *PP_LAYOUT])
    assert_equivalent(single, pp)


MOE_STUDENT = [
    "model=moe-tiny", *TINY_MODEL, "model.num_layers=1", "model.hidden_size=32", "model.num_kv_heads=2",
    "model.moe_ffn_hidden_size=32", "distill.loss=jsd", "distill.temperature=2.0",
]  # fmt: skip
MOE_LAYOUT = ["parallel.dp=2", "parallel.tp=2"]


def test_moe_student_at_dp2_tp2_matches_single_process_with_its_router_losses(tmp_path, teacher, tiny_data):
    """An MoE student (llama family, 8 experts, top-2) distilled from the dense GPT teacher on 4
    processes (dp2 x tp2) equals one process; its balance and z-losses join the loss (step 1 without
    them is lower by exactly the coefficients times the logged values)."""
    single, tp, no_aux = tmp_path / "single", tmp_path / "dp2-tp2", tmp_path / "no-aux"
    distill(single, teacher, tiny_data, *MOE_STUDENT)
    distill(tp, teacher, tiny_data, *MOE_STUDENT, *MOE_LAYOUT, "launch.nproc_per_node=4")
    assert_layout(tp, 4, [*MOE_STUDENT, *MOE_LAYOUT])
    assert_equivalent(single, tp)
    distill(no_aux, teacher, tiny_data, *MOE_STUDENT, "model.aux_loss_coef=0", "model.z_loss_coef=0",
            "train.max_steps=1", "train.save_every=1", "train.eval_every=1")  # fmt: skip
    first = next(r for r in read_metrics(single) if r.get("step") == 1 and "loss" in r)
    without = train_losses(no_aux)[1]
    aux = 0.01 * first["moe_balance_loss"] + 0.001 * first["moe_z_loss"]  # recipes/model/moe-tiny.yaml
    assert aux > 1e-3 and abs(first["loss"] - without - aux) < 1e-3 * aux + 1e-6, (first, without, aux)
