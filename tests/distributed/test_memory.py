"""Per-rank bytes of parameters + gradients + optimizer state, measured inside the workers.

Each rank records the peak bytes it holds for each of the three during a step (parameters right
after the last forward, when a stage keeps them gathered, and at rest; gradients after backward;
AdamW state after the step); the trainer writes the maximum over ranks to summary.json as
`state_bytes`. At sharding=4 stage 3 a rank holds about a quarter of what a dp=4 rank holds
(P + P + 2P for params, grads, Adam moments); stages 1 and 2 fall in between, in order.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import pretrain
from tests.helpers import assert_layout


def state_bytes(run_dir) -> dict[str, int]:
    return json.loads((run_dir / "summary.json").read_text())["state_bytes"]


@pytest.mark.slow
def test_sharding_stages_divide_model_state(layout_run, tiny_data, tmp_path):
    measured = {"stage3": state_bytes(layout_run("sharding4-stage3"))}
    for name, overrides in {
        "dp4": ["parallel.dp=4"],
        "stage1": ["parallel.sharding=4", "parallel.sharding_stage=1"],
        "stage2": ["parallel.sharding=4", "parallel.sharding_stage=2"],
    }.items():
        run_dir = pretrain(tmp_path / name, tiny_data, 4, *overrides, steps=2)
        assert_layout(run_dir, 4, overrides)  # dp4: replicate; stage 1: zero1; stage 2: fsdp
        measured[name] = state_bytes(run_dir)
    dp, s1, s2, s3 = (measured[k] for k in ("dp4", "stage1", "stage2", "stage3"))
    assert dp["params"] == s1["params"] == s2["params"], measured  # stages 1-2 hold whole parameters at peak
    assert s3["total"] <= 0.3 * dp["total"], measured
    assert dp["total"] > s1["total"] > s2["total"] > s3["total"], measured
    # what each stage shards: 1 the optimizer state, 2 + gradients, 3 + parameters
    assert s1["optim"] <= 0.3 * dp["optim"] and s1["grads"] == dp["grads"], measured
    assert s2["grads"] <= 0.3 * dp["grads"], measured
    assert s3["params"] <= 0.3 * dp["params"], measured
