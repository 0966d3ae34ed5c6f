"""Pipeline parallelism trains like one process: every schedule, both families, with TP and DP
(losses, gradient norms, step-1 gradients and weight updates: tests/helpers.py assert_equivalent;
the stages and schedule that ran: assert_layout).

Each run is the real CLI (`suite pretrain ... launch.nproc_per_node=N parallel.pp=2`), 10 steps of
the tiny model with 4 layers (so pp=2 x vpp=2 has a layer per stage), global batch 16 as 4
micro-batches of 4; the reference is the single-process run with the same seed and data. The
final checkpoint of a pipeline run (one DCP shard per stage part) is loaded into a plain model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, ParallelConfig
from suite.models import build_model
from suite.parallel.dims import ParallelDims, check_pipeline
from suite.parallel.pipeline import plan_stages, split_layers
from tests.distributed.conftest import LLAMA, pretrain
from tests.helpers import (
    assert_close_losses,
    assert_equivalent,
    assert_layout,
    override_value,
    read_metrics,
    train_losses,
)

FOUR_LAYERS = ["model.num_layers=4"]
PP = ["parallel.pp=2"]
INTERLEAVED = [*PP, "parallel.pp_schedule=interleaved_1f1b", "parallel.vpp=2"]

# name -> (processes, overrides, reference run name)
PP_LAYOUTS: dict[str, tuple[int, list[str], str]] = {
    "gpt4": (1, [], ""),
    "llama4": (1, LLAMA, ""),
    "pp2-gpipe": (2, [*PP, "parallel.pp_schedule=gpipe"], "gpt4"),
    "pp2-1f1b": (2, [*PP, "parallel.pp_schedule=1f1b"], "gpt4"),
    "pp2-interleaved": (2, INTERLEAVED, "gpt4"),
    # zero bubble splits backward into input- and weight-gradient passes: run it under full recompute
    "pp2-zero-bubble-recompute": (
        2,
        [*PP, "parallel.pp_schedule=zero_bubble", "parallel.vpp=2", "recompute=full"],
        "gpt4",
    ),
    "llama-pp2-1f1b": (2, [*LLAMA, *PP, "parallel.pp_schedule=1f1b"], "llama4"),
    # packed documents: positions and the document mask reach every stage as schedule kwargs
    "gpt4-doc": (1, ["data.doc_mask=true"], ""),
    "pp2-1f1b-doc": (2, ["data.doc_mask=true", *PP, "parallel.pp_schedule=1f1b"], "gpt4-doc"),
    # RoPE under sp: a later stage's hidden states are this tp rank's slice of the sequence, so the
    # positions must come with the micro-batch (suite.train.pipeline_step.with_positions); counted from
    # the slice, the RoPE tables are half the queries' length and the run fails
    "llama-pp2-tp2": (4, [*LLAMA, *PP, "parallel.tp=2", "parallel.sp=true"], "llama4"),
    "dp2-pp2-tp2": (8, ["parallel.dp=2", *PP, "parallel.tp=2"], "gpt4"),
}


@pytest.fixture(scope="session")
def pp_run(tiny_data, tmp_path_factory):
    """pp_run(name) -> run dir of that 4-layer layout's 10-step run (trained on first request)."""
    root = tmp_path_factory.mktemp("pp_layouts")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nproc, overrides, _ = PP_LAYOUTS[name]
            done[name] = pretrain(root / name, tiny_data, nproc, *FOUR_LAYERS, *overrides)
        return done[name]

    return get


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def check_layout(pp_run, name: str) -> None:
    nproc, overrides, reference = PP_LAYOUTS[name]
    ref_dir, run_dir = pp_run(reference), pp_run(name)
    layout = assert_layout(run_dir, nproc, [*FOUR_LAYERS, *overrides])
    assert layout["pp_schedule"] == override_value(overrides, "parallel.pp_schedule", "1f1b")
    assert_equivalent(ref_dir, run_dir)
    if not any(o.startswith(("parallel.dp=", "parallel.sharding=")) for o in overrides):
        # the forward-only path (with data parallelism each replica evaluates its own batches)
        assert_close_losses(val_losses(ref_dir), val_losses(run_dir), rtol=1e-4)


@pytest.mark.parametrize("name", ["pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "llama-pp2-1f1b"])
def test_pipeline_schedule_matches_single_process(pp_run, name):
    check_layout(pp_run, name)


def test_packed_documents_under_pp_match_single_process(pp_run):
    """data.doc_mask=true at pp=2 (1f1b): every stage gets the micro-batch's positions and document
    mask, so losses (train and held-out), gradients and updates equal one process's; the mask is
    really on (the masked reference trains differently from the unmasked one)."""
    check_layout(pp_run, "pp2-1f1b-doc")
    masked, plain = train_losses(pp_run("gpt4-doc")), train_losses(pp_run("gpt4"))
    assert max(abs(masked[s] - plain[s]) for s in masked) > 1e-3, (masked, plain)


def test_zero_bubble_with_recompute_matches_single_process(pp_run):
    check_layout(pp_run, "pp2-zero-bubble-recompute")


@pytest.mark.slow
def test_pp2_tp2_matches_single_process(pp_run):
    check_layout(pp_run, "llama-pp2-tp2")


@pytest.mark.slow
def test_dp2_pp2_tp2_matches_single_process(pp_run):
    check_layout(pp_run, "dp2-pp2-tp2")


@pytest.mark.parametrize(
    ("source", "target"),
    [("pp2-gpipe", "gpt4"), ("gpt4", "pp2-interleaved")],
)
def test_checkpoint_moves_between_pipeline_and_plain_layouts(pp_run, tiny_data, tmp_path, source, target):
    """Saved at step 5 by one layout, continued to step 10 by another (model and AdamW state)."""
    run_dir = tmp_path / f"{source}-to-{target}"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(pp_run(source) / "checkpoints" / "step_5", run_dir / "checkpoints" / "step_5")
    nproc, overrides, _ = PP_LAYOUTS[target]
    pretrain(run_dir, tiny_data, nproc, *FOUR_LAYERS, *overrides)
    assert_layout(run_dir, nproc, [*FOUR_LAYERS, *overrides])
    got = train_losses(run_dir)
    assert sorted(got) == list(range(6, 11)), got
    assert_equivalent(pp_run("gpt4"), run_dir, from_step=5, grad_step=None)


# ---- no processes: splitting and validation --------------------------------------------------------
def test_split_balances_parameters_with_embeddings_and_head():
    assert split_layers([10] * 4, 0, 0, 2) == [[0, 1], [2, 3]]
    assert split_layers([10] * 4, 0, 0, 4) == [[0], [1], [2], [3]]
    # a heavy embedding pushes layers to the later stages, a heavy head to the earlier ones
    assert split_layers([10] * 6, 25, 0, 2) == [[0, 1], [2, 3, 4, 5]]
    assert split_layers([10] * 6, 0, 15, 2) == [[0, 1, 2, 3], [4, 5]]
    assert split_layers([10] * 8, 30, 30, 4) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert split_layers([10] * 8, 10, 10, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # ties: even counts
    with pytest.raises(ConfigError, match="cannot split 2 layers into 3"):
        split_layers([1, 1], 0, 0, 3)


def test_plan_stages_counts_a_tied_head_on_the_last_stage():
    cfg = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, vocab_size=4096, max_seq_len=64)
    stages = plan_stages(build_model(cfg), 2)  # embedding 262k + 4k, head 262k, a layer ~50k
    assert [len(s) for s in stages] == [4, 4] and sum(stages, []) == list(range(8))
    small_vocab = plan_stages(
        build_model(ModelConfig(num_layers=8, hidden_size=64, num_heads=4, vocab_size=64, max_seq_len=1024)),
        2,
    )
    assert len(small_vocab[0]) < len(small_vocab[1])  # the 1024-row position table weighs on stage 0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"pp_schedule": "1f1b", "vpp": 2}, "runs one stage per rank"),
        ({"pp_schedule": "interleaved_1f1b", "vpp": 1}, "needs parallel.vpp >= 2"),
        ({"pp_schedule": "1f1b", "micro_batch_size": 16, "global_batch_size": 16}, "at least parallel.pp=2"),
        (
            {"pp_schedule": "interleaved_1f1b", "vpp": 2, "micro_batch_size": 1, "global_batch_size": 5},
            "equal rounds",
        ),
        ({"pp_schedule": "bubbly"}, "not a schedule"),
    ],
)
def test_impossible_pipeline_settings_are_one_line_errors(overrides, match):
    cfg = ParallelConfig(pp=2, **overrides)
    dims = ParallelDims.from_config(cfg, 2)
    with pytest.raises(ConfigError, match=match) as info:
        check_pipeline(cfg, dims, False)
    assert "\n" not in str(info.value)
    plain = ParallelConfig(pp=2)
    check_pipeline(plain, ParallelDims.from_config(plain, 2), False)  # fp16 too: nothing to refuse here
    zero_bubble = ParallelConfig(pp=2, pp_schedule="zero_bubble", vpp=2)
    with pytest.raises(ConfigError, match="train.compile=false"):
        check_pipeline(zero_bubble, ParallelDims.from_config(zero_bubble, 2), compile_blocks=True)
    check_pipeline(zero_bubble, ParallelDims.from_config(zero_bubble, 2), False)  # fine without compile
    with pytest.raises(ConfigError, match="model.tie_embeddings=false"):  # the tied embedding used twice
        check_pipeline(zero_bubble, ParallelDims.from_config(zero_bubble, 2), False, tied_mtp=True)
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", vpp=2)
    check_pipeline(interleaved, ParallelDims.from_config(interleaved, 2), False, tied_mtp=True)
