"""Activation recompute through the real CLI: every granularity trains exactly like `recompute=none`.

Recompute changes what is kept for backward, never the math: per-step losses and final weights
must match the run without recompute (the shared single-process `single` layout), in one process
and composed with tensor parallelism (+ sequence parallel) and FSDP, which apply it after TP and
before sharding. Recompute under pipeline stages is covered in test_pipeline.py.
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import pretrain
from tests.helpers import assert_equivalent, assert_layout

RUNS = {
    "full": (1, ["recompute=full"]),
    "full_attn-skip1": (1, ["recompute=full_attn", "recompute.skip_layers=1"]),
    "core_attn-first1": (1, ["recompute=core_attn", "recompute.num_layers=1"]),
    "tp2-sp-full_attn": (2, ["parallel.tp=2", "parallel.sp=true", "recompute=full_attn"]),
    "sharding2-stage3-full": (2, ["parallel.sharding=2", "parallel.sharding_stage=3", "recompute=full"]),
}


def check(layout_run, tiny_data, tmp_path, name: str) -> None:
    nproc, overrides = RUNS[name]
    run_dir = pretrain(tmp_path / name, tiny_data, nproc, *overrides)
    ref_dir = layout_run("single")  # the same tiny model and data, recompute=none
    layout = assert_layout(run_dir, nproc, overrides)
    recomputed = {k: v for view in layout["ranks"] for k, v in view["modules"].items() if "recompute" in k}
    assert recomputed == RECOMPUTED[name], recomputed
    assert_equivalent(ref_dir, run_dir)


# which blocks each run recomputes, and how (summary.json layout, read off the model)
RECOMPUTED = {
    "full": {"recompute:full": ["layers.0", "layers.1"]},
    "full_attn-skip1": {"recompute:full_attn": ["layers.1"]},
    "core_attn-first1": {"recompute:core_attn": ["layers.0"]},
    "tp2-sp-full_attn": {"recompute:full_attn": ["layers.0", "layers.1"]},
    "sharding2-stage3-full": {"recompute:full": ["layers.0", "layers.1"]},
}


@pytest.mark.parametrize("name", ["full", "full_attn-skip1", "core_attn-first1"])
def test_recompute_granularity_matches_none(layout_run, tiny_data, tmp_path, name):
    check(layout_run, tiny_data, tmp_path, name)


@pytest.mark.parametrize("name", ["tp2-sp-full_attn", "sharding2-stage3-full"])
def test_recompute_composes_with_tp_and_fsdp(layout_run, tiny_data, tmp_path, name):
    check(layout_run, tiny_data, tmp_path, name)
