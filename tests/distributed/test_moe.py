"""Mixture of Experts: moe-tiny trains with balanced experts, expert parallelism matches one process.

Runs (real CLI, TINY_MODEL-sized `recipe=moe-tiny`: 2 layers, 8 experts, top-2, dropless):
    single   1 process, 10 steps (the reference; also the moe-tiny training check)
    ep2-dp2  4 processes: dp=2 x sharding=2 (HSDP), ep=2 -> 2 replicas of each expert slice, 5 steps
    ep4      4 processes: dp=2 x sharding=2, ep=4 -> every rank holds 2 experts, 5 steps
    ep2-zero1  2 processes: sharding=2 at stage 1 (ZeRO-1: dense AdamW state in row slices), ep=2 ->
             each rank holds 4 experts and their whole AdamW state, 5 steps
    resume   the ep2-dp2 step-5 checkpoint resumed by one process to step 10
    tp2      2 processes: tp=2, expert-tensor-parallel (each expert split on its ffn dim), 10 steps
    ep2-tp2  4 processes: sharding=2 (FSDP), ep=2, tp=2 -> each rank holds half of 4 experts, 10 steps
    pp2      2 processes: pp=2 (1f1b), one MoE layer per stage, 10 steps
    ep2-pp2  4 processes: dp=2, ep=2, pp=2: each stage's experts split over its own 2 data ranks, 10 steps
    dp2-tp2-pp2-ep2  8 processes, four axes: dp=2 x tp=2 x pp=2, ep=2 over the dp ranks (each stage's
             experts split over ep and each expert over tp), 10 steps
    cp2      2 processes: cp=2, each rank routes its two sequence chunks, the balance loss summed
             over the cp group (suite.parallel.context_parallel_moe), 10 steps
    cp2-ep2  4 processes: dp=2 x cp=2, ep=2 over the two data ranks of each cp coordinate, 10 steps
    shared-cp2  2 processes: cp=2 with a shared expert and capacity dropping: the cp ranks rank
             their assignments over the whole micro-batch, so the same ones drop as in one process
    shared-single / shared-tp2-sp   a shared expert and capacity dropping (capacity_factor=1.0), one
             process against tp=2 + sequence parallelism: the sp gather / slice of the MoE layer,
             the shared MLP's tensor-parallel plan, and dropping decided identically on tp ranks
Dropless routing (capacity_factor=null, the recipe's) because equivalence is the claim: routing is
decided per rank on its own tokens, so dropping would match too, but a tie in capacity order would
make one test depend on two features at once.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.conftest import COMMON
from tests.helpers import TINY_MODEL, assert_equivalent, assert_layout, read_metrics, run_suite

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# a constant learning rate after the 1-step warm-up: the 5-step ep runs take the 10-step
# reference's learning rates (a cosine schedule depends on train.max_steps)
MOE = [
    "recipe=moe-tiny",
    *TINY_MODEL,
    "model.num_kv_heads=2",
    "model.moe_ffn_hidden_size=64",
    "sched=constant",
]
SHARED_DROPPING = ["model.num_shared_experts=1", "model.capacity_factor=1.0"]
LAYOUTS = {
    "single": (1, [], 10),
    "ep2-dp2": (4, ["parallel.dp=2", "parallel.sharding=2", "parallel.ep=2"], 5),
    "ep4": (4, ["parallel.dp=2", "parallel.sharding=2", "parallel.ep=4"], 5),
    "ep2-zero1": (2, ["parallel.sharding=2", "parallel.sharding_stage=1", "parallel.ep=2"], 5),
    "tp2": (2, ["parallel.tp=2"], 10),
    "ep2-tp2": (4, ["parallel.sharding=2", "parallel.ep=2", "parallel.tp=2"], 10),
    "shared-single": (1, SHARED_DROPPING, 10),
    "shared-tp2-sp": (2, [*SHARED_DROPPING, "parallel.tp=2", "parallel.sp=true"], 10),
    "pp2": (2, ["parallel.pp=2"], 10),
    "ep2-pp2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2"], 10),
    # four axes at once on 8 processes: dp=2 x tp=2 x pp=2, the experts over ep=2 (the dp ranks)
    "dp2-tp2-pp2-ep2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2"], 10),
    "cp2": (2, ["parallel.cp=2"], 10),
    "cp2-ep2": (4, ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2"], 10),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2"], 10),
    "shared-cp2": (2, [*SHARED_DROPPING, "parallel.cp=2"], 10),
}
TP_REFERENCE = {
    "tp2": "single",
    "ep2-tp2": "single",
    "shared-tp2-sp": "shared-single",
}


@pytest.fixture(scope="module")
def moe_runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    done: dict = {}

    def get(name: str):
        if name not in done:
            if name == "resume":  # the ep=2 run's step-5 checkpoint, continued by one process
                run_dir = root / "resume"
                shutil.copytree(get("ep2-dp2"), run_dir)
                nproc, overrides, steps = 1, [], 10
            else:
                nproc, overrides, steps = LAYOUTS[name]
                run_dir = root / name
            run_suite(
                "pretrain",
                *MOE,
                f"data.path={tiny_data}",
                f"run.dir={run_dir}",
                *COMMON,
                "parallel.micro_batch_size=4",
                f"train.max_steps={steps}",
                *overrides,
                f"launch.nproc_per_node={nproc}",
                timeout=420,
                check=True,
            )
            done[name] = run_dir
        return done[name]

    return get


def test_moe_tiny_trains_with_reported_balance(moe_runs):
    records = [r for r in read_metrics(moe_runs("single")) if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"] - 0.2
    for r in records:
        assert 1.0 <= r["moe_load_max_over_mean"] < 2.5  # no expert gets more than 2.5x its share
        assert 0.99 < r["moe_balance_loss"] < 1.2  # 1.0 = perfectly balanced
        assert r["moe_dropped_frac"] == 0.0  # dropless
        assert "a2a_bytes" not in r


@pytest.mark.parametrize("name", ["ep2-dp2", "ep4", "ep2-zero1"])
def test_expert_parallel_matches_single_process(moe_runs, name):
    nproc, overrides, steps = LAYOUTS[name]
    assert_layout(moe_runs(name), nproc, overrides)
    assert_equivalent(moe_runs("single"), moe_runs(name), to_step=steps)
    records = [r for r in read_metrics(moe_runs(name)) if "loss" in r]
    assert all(r["a2a_bytes"] > 0 for r in records)
    # same tokens, same routing: the load figures are the single process's too
    single = {r["step"]: r for r in read_metrics(moe_runs("single"))}
    for r in records:
        assert abs(r["moe_load_max_over_mean"] - single[r["step"]]["moe_load_max_over_mean"]) < 1e-9


def test_expert_parallel_checkpoint_resumes_in_one_process(moe_runs):
    assert_layout(moe_runs("resume"), 1, [])
    assert_equivalent(moe_runs("single"), moe_runs("resume"), from_step=5, grad_step=None)


@pytest.mark.parametrize("name", list(TP_REFERENCE))
def test_tensor_parallel_moe_matches_single_process(moe_runs, name):
    """Expert-tensor-parallel MoE (router replicated, experts split on ffn) trains like one process."""
    nproc, overrides, steps = LAYOUTS[name]
    reference = moe_runs(TP_REFERENCE[name])
    layout = assert_layout(moe_runs(name), nproc, overrides)
    assert all(view["modules"].get("expert_tensor_parallel") for view in layout["ranks"]), layout
    assert_equivalent(reference, moe_runs(name), to_step=steps)
    records = [r for r in read_metrics(moe_runs(name)) if "loss" in r]
    assert len(records) == steps
    single = {r["step"]: r for r in read_metrics(reference)}
    if name.startswith("shared"):  # the dropping path really ran
        assert all(r["moe_dropped_frac"] > 0 for r in records)
    for r in records:  # routing, dropping and the balance / z-losses are the single process's
        for key in ("moe_load_max_over_mean", "moe_balance_loss", "moe_z_loss", "moe_dropped_frac"):
            assert abs(r[key] - single[r["step"]][key]) <= 1e-6 * abs(single[r["step"]][key]), (key, r)
        assert ("a2a_bytes" in r) == ("parallel.ep=2" in overrides)


@pytest.mark.parametrize("name", ["pp2", "ep2-pp2", "dp2-tp2-pp2-ep2", "cp2-pp2"])
def test_pipelined_moe_matches_single_process(moe_runs, name):
    """MoE layers inside pipeline stages: the first stage's balance + z-losses reach the loss through
    its output's backward, the logged loss and load metrics sum every stage's layers."""
    nproc, overrides, steps = LAYOUTS[name]
    layout = assert_layout(moe_runs(name), nproc, overrides)
    assert sorted({tuple(view["layers"]) for view in layout["ranks"]}) == [(0,), (1,)], layout
    reference = moe_runs("single")
    assert_equivalent(reference, moe_runs(name), to_step=steps)
    records = [r for r in read_metrics(moe_runs(name)) if "loss" in r]
    assert len(records) == steps
    single = {r["step"]: r for r in read_metrics(reference)}
    for r in records:
        for key in ("moe_load_max_over_mean", "moe_balance_loss", "moe_z_loss"):
            assert abs(r[key] - single[r["step"]][key]) <= 1e-6 * abs(single[r["step"]][key]), (key, r)
        assert ("a2a_bytes" in r) == ("parallel.ep=2" in overrides)
        # one stage's weighted router losses (one MoE layer of two) are far above the loss tolerance,
        # so a stage whose aux loss missed the logged loss (or the gradients) would fail the check above
        stage_aux = 0.01 * r["moe_balance_loss"] + 0.001 * r["moe_z_loss"]  # moe-tiny's coefficients
        assert stage_aux > 10 * 1e-4 * r["loss"], (stage_aux, r["loss"])


@pytest.mark.parametrize("name", ["cp2", "cp2-ep2", "shared-cp2"])
def test_context_parallel_moe_matches_single_process(moe_runs, name):
    """The sequence split over cp ranks: routing per token on each rank, the balance loss's f and P
    summed over the cp group (with gradient), capacity ranked over the whole micro-batch, so losses,
    weights, load figures and dropped assignments are one process's."""
    nproc, overrides, steps = LAYOUTS[name]
    layout = assert_layout(moe_runs(name), nproc, overrides)
    for view in layout["ranks"]:  # every MoE layer sums its router statistics over the cp group
        assert view["modules"].get("context_parallel_moe") == [
            "layers.0.feed_forward",
            "layers.1.feed_forward",
        ]
    reference = moe_runs("shared-single" if name.startswith("shared") else "single")
    assert_equivalent(reference, moe_runs(name), to_step=steps)
    records = [r for r in read_metrics(moe_runs(name)) if "loss" in r]
    assert len(records) == steps
    single = {r["step"]: r for r in read_metrics(reference)}
    if name.startswith("shared"):  # the dropping path really ran
        assert all(r["moe_dropped_frac"] > 0 for r in records)
    for r in records:
        for key in ("moe_load_max_over_mean", "moe_balance_loss", "moe_z_loss", "moe_dropped_frac"):
            assert abs(r[key] - single[r["step"]][key]) <= 1e-6 * abs(single[r["step"]][key]), (key, r)
        assert ("a2a_bytes" in r) == ("parallel.ep=2" in overrides)
