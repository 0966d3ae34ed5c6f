"""Hierarchical all-to-all (parallel.ep_dispatch) on two loopback "nodes" x 2 processes, ep=4.

Two real multi-node launches of moe-tiny (`launch.nnodes=2`, one `suite pretrain` per node on
127.0.0.1, dp2 x sharding2, ep=4: each node holds 4 of the 8 experts), 3 steps each:
    flat   parallel.ep_dispatch=flat: every (token, expert) row straight to the expert's rank
    auto   the default: the ep group spans both nodes, so the hierarchical dispatch runs (each token
           once per destination node, then inside the node; suite/parallel/hierarchical_dispatch.py)
The hierarchical run trains like the flat one (losses within 1e-6, gradients, updates) and reports
fewer bytes crossing nodes per step (metrics.jsonl `a2a_internode_bytes`, from the split sizes
each rank exchanged).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import COMMON
from tests.distributed.test_moe import MOE
from tests.helpers import assert_equivalent, assert_layout, read_metrics, run_loopback_nodes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

EP4 = ["parallel.dp=2", "parallel.sharding=2", "parallel.ep=4"]
STEPS = 3


@pytest.fixture(scope="module")
def two_node_runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("hier")
    runs = {}
    for name in ("flat", "auto"):
        run_dir = root / name
        args = [
            "pretrain",
            *MOE,
            f"data.path={tiny_data}",
            f"run.dir={run_dir}",
            *COMMON,
            f"train.max_steps={STEPS}",
            *EP4,
            f"parallel.ep_dispatch={name}",
            "launch.nproc_per_node=2",
        ]
        (root / f"{name}-logs").mkdir()
        run_loopback_nodes(args, root / f"{name}-logs")
        runs[name] = run_dir
    return runs


def test_hierarchical_dispatch_matches_flat_and_crosses_nodes_less(two_node_runs):
    flat, hier = two_node_runs["flat"], two_node_runs["auto"]
    for run, hierarchical in ((flat, False), (hier, True)):
        layout = assert_layout(run, 4, EP4)
        for view in layout["ranks"]:
            assert bool(view["modules"].get("hierarchical_dispatch")) == hierarchical, view["modules"]
    assert_equivalent(flat, hier, loss_rtol=1e-6, norm_rtol=1e-5, min_update=1e-4)
    flat_steps = {r["step"]: r for r in read_metrics(flat) if "loss" in r}
    hier_steps = {r["step"]: r for r in read_metrics(hier) if "loss" in r}
    assert sorted(flat_steps) == sorted(hier_steps) == list(range(1, STEPS + 1))
    for step, f in flat_steps.items():
        h = hier_steps[step]
        assert abs(h["loss"] - f["loss"]) <= 1e-6 * abs(f["loss"]), (step, h["loss"], f["loss"])
        # the same routing: the load figures are identical
        assert h["moe_load_max_over_mean"] == f["moe_load_max_over_mean"]
        assert 0 < h["a2a_internode_bytes"] < f["a2a_internode_bytes"], (h, f)
        assert 0 < f["a2a_internode_bytes"] < f["a2a_bytes"]
