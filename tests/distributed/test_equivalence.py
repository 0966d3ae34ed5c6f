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
from tests.helpers import assert_equivalent, assert_layout, summary

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
        "dp2-spawn",
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tp2-compile", "llama-cp2-compile", "llama-cp2-pp2"])
def test_compiled_and_cp_pp_layouts_match_single_process(layout_run, name):
    """Compiled blocks under tp and cp (the llama-single reference runs eager), and cp inside
    pipeline stages: besides the layout checks, every block held was compiled (and only those
    asked to), and with pp every stage's blocks run the cp attention."""
    check_layout(layout_run, name)
    overrides = LAYOUTS[name][1]
    layout = summary(layout_run(name))["layout"]
    compiled = "train.compile=true" in overrides
    for view in layout["ranks"]:
        blocks = {f"layers.{i}" for i in view["layers"]}
        assert set(view["modules"].get("compiled", [])) == (blocks if compiled else set()), view["modules"]
        if "parallel.cp=2" in overrides:
            cp_modules = view["modules"]["context_parallel"]
            assert {m.rsplit(".attention", 1)[0] for m in cp_modules} == blocks, cp_modules
    if "parallel.pp=2" in overrides:
        assert {tuple(v["layers"]) for v in layout["ranks"]} == {(0,), (1,)}, layout["ranks"]
        assert sorted(r for v in layout["ranks"] for r in v["ranks"]) == [0, 1, 2, 3]


def test_logged_metrics_come_from_rank_zero_only(layout_run):
    """One metrics.jsonl line per logged step (not one per rank), with the global-batch loss."""
    from tests.helpers import read_metrics

    records = read_metrics(layout_run("dp2"))
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 11))
