"""Every layout trains like one process (fp32, gloo): the same loss and gradient norm at every
step, the same gradient of every parameter at step 1, the same update of every parameter after 10
steps (tests/helpers.py: assert_equivalent), and the layout that ran is the one asked for
(summary.json `layout`: tests/helpers.py: assert_layout).

Reference: the single-process run with the same seed, data and global batch (16 sequences, as 4
micro-batches of 4). Each layout is the real CLI with launch.nproc_per_node=N; its final
checkpoint is loaded into a plain model whatever layout wrote it (DCP).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import LAYOUTS, reference_name
from tests.helpers import assert_equivalent, assert_layout

# loading a checkpoint into a plain model in this (non-distributed) test process is the intent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def check_layout(layout_run, name: str) -> None:
    ref_dir, run_dir = layout_run(reference_name(name)), layout_run(name)
    assert_layout(ref_dir, 1, LAYOUTS[reference_name(name)][1])
    assert_layout(run_dir, *LAYOUTS[name])
    assert_equivalent(ref_dir, run_dir)


@pytest.mark.parametrize(
    "name",
    [
        "dp2",
        "sharding2-stage1",
        "sharding2-stage2",
        "sharding2-stage3",
        "sharding2-stage3-prefetch",
        "sharding2-offload",
        "sharding2-stage3-chunked-loss",
        "tp2",
        "tp2-sp",
        "llama-tp2",
        "llama-tp2-sp",
        "llama-tp2-fused",
    ],
)
def test_two_process_layout_matches_single_process(layout_run, name):
    check_layout(layout_run, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2-tp2", "sharding2-tp2", "hsdp"])
def test_four_process_layout_matches_single_process(layout_run, name):
    check_layout(layout_run, name)


def test_logged_metrics_come_from_rank_zero_only(layout_run):
    """One metrics.jsonl line per logged step (not one per rank), with the global-batch loss."""
    from tests.helpers import read_metrics

    records = read_metrics(layout_run("dp2"))
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 11))
