"""Expert parallelism with offload: the experts in their own FSDP2 group over "edp", on the host.

Runs (real CLI, the moe-tiny model of test_moe.py):
    single        1 process, 10 steps (the reference)
    ep2-offload   2 processes: sharding=2 at stage 3, ep=2, offload -> each rank holds 4 experts,
                  one replica of each ("edp" = 1): FSDP over a 1-rank axis, divided by 2 data ranks
    ep2-edp2-offload  4 processes: sharding=4 at stage 3, ep=2, offload -> two replicas of each
                  expert slice, sharded between them by FSDP (reduce-scatter over edp), 5 steps
    resume        the ep2-edp2-offload step-5 checkpoint (experts saved from their FSDP shards)
                  resumed by one process to step 10
Both against one process: losses, grad norms (expert shards counted once), step-1 gradients and
the weight updates, and the layout: expert weights FSDP-sharded over edp with CPUOffloadPolicy.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.conftest import COMMON
from tests.distributed.test_moe import MOE
from tests.helpers import assert_equivalent, assert_layout, run_suite

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 5
OFFLOAD = ["parallel.sharding_stage=3", "parallel.offload=true", "parallel.ep=2"]
LAYOUTS = {
    "single": (1, [], 10),
    "ep2-offload": (2, ["parallel.sharding=2", *OFFLOAD], STEPS),
    "ep2-edp2-offload": (4, ["parallel.sharding=4", *OFFLOAD], STEPS),
}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_offload")
    done: dict = {}

    def get(name: str):
        if name not in done:
            if name == "resume":  # the 4-process run's step-5 checkpoint, continued by one process
                shutil.copytree(get("ep2-edp2-offload"), root / name)
                nproc, overrides, steps = 1, [], 10
            else:
                nproc, overrides, steps = LAYOUTS[name]
            run_suite(
                "pretrain",
                *MOE,
                f"data.path={tiny_data}",
                f"run.dir={root / name}",
                *COMMON,
                f"train.max_steps={steps}",
                *overrides,
                f"launch.nproc_per_node={nproc}",
                timeout=420,
                check=True,
            )
            done[name] = root / name
        return done[name]

    return get


@pytest.mark.parametrize("name", ["ep2-offload", "ep2-edp2-offload"])
def test_offloaded_experts_match_single_process(runs, name):
    nproc, overrides, _ = LAYOUTS[name]
    layout = assert_layout(runs(name), nproc, overrides)
    for view in layout["ranks"]:
        experts = [p for n, p in view["params"].items() if ".experts." in n]
        # (edp, ep) mesh: FSDP's shard over edp, then the ep slice of the experts
        assert all(p.startswith("edp:") and ",ep:Shard(dim=0)" in p for p in experts), experts
    assert_equivalent(runs("single"), runs(name), to_step=STEPS)


def test_offloaded_experts_checkpoint_resumes_in_one_process(runs):
    assert_layout(runs("resume"), 1, [])
    assert_equivalent(runs("single"), runs("resume"), from_step=STEPS, grad_step=None)
