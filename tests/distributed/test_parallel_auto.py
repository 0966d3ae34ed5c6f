"""`parallel=auto` trains like one process: at world size 4 (gloo, this CPU) the planner picks a
layout, the run trains with it, and its losses (and gradient norms, step-1 gradients and 10-step
updates: tests/helpers.py assert_equivalent) equal the single-process run's within 1e-4 (fp32).

With a global batch of 2 sequences (the Llama-family tiny model) the four processes cannot all be data ranks: the planner must
reach for model parallelism (context parallelism here), and that run equals one process too.

The layout that ran is the one the planner chose: plan.json's overrides are checked against each
rank's placement (summary.json `layout`, tests/helpers.py assert_layout) and against config.yaml.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import LAYOUTS, LLAMA, pretrain
from tests.helpers import assert_close_losses, assert_equivalent, assert_layout, run_config, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def auto_run(tiny_data, tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("auto") / "run", tiny_data, 4, "parallel=auto")


def check_chosen_layout_ran(run_dir) -> dict:
    """plan.json's chosen layout is the one each rank held and the one config.yaml records."""
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan["chosen_overrides"].split()
    assert plan["world"] == 4 and plan["chosen"]["layout"] == plan["ranked"][0]["layout"]
    layout = assert_layout(run_dir, 4, chosen)
    assert layout["degrees"], layout  # the four processes are used: some degree above 1
    saved = run_config(run_dir)  # config.yaml records the layout that ran, not `auto`
    assert saved.parallel.auto is False
    for override in chosen:
        key, value = override.split("=", 1)
        if key.startswith("parallel."):
            assert str(getattr(saved.parallel, key.removeprefix("parallel."))).lower() == value, override
    assert saved.recompute.granularity == plan["chosen"]["parallel"]["recompute"]
    return plan


def test_parallel_auto_at_world_4_picks_a_layout_and_trains_like_one_process(layout_run, auto_run):
    check_chosen_layout_ran(auto_run)
    ref = layout_run("single")
    assert_layout(ref, 1, LAYOUTS["single"][1])
    losses = train_losses(auto_run)
    assert len(losses) == 10
    assert_close_losses(train_losses(ref), losses, rtol=1e-4)
    assert_equivalent(ref, auto_run)


def test_a_small_global_batch_makes_auto_choose_model_parallelism(tiny_data, tmp_path):
    # the Llama-family tiny model: no attention biases, whose noise-only gradients AdamW would blow up
    # to lr-sized updates at so small a batch (tests/helpers.py NOISE_ONLY)
    small = [*LLAMA, "parallel.global_batch_size=2", "parallel.micro_batch_size=1"]
    ref = pretrain(tmp_path / "single", tiny_data, 1, *small)
    run = pretrain(tmp_path / "auto", tiny_data, 4, *small, "parallel=auto")
    plan = check_chosen_layout_ran(run)
    parallel = plan["chosen"]["parallel"]
    assert parallel["dp"] * parallel["sharding"] <= 2 < parallel["tp"] * parallel["pp"] * parallel["cp"] * 2
    assert_close_losses(train_losses(ref), train_losses(run), rtol=1e-4)
    assert_equivalent(ref, run)
