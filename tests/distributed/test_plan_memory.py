"""The planner's per-rank peak memory against real gloo runs: `train.tensor_memory=true` counts each
rank's live tensor storage over the last step (suite.train.tensor_memory), and the cost model
(suite.plan.cost.evaluate, the run's own config on the `cpu` preset) predicts the worst rank's.
Data parallelism is the case one process cannot show: replicate's unsharded parameter copies and
the foreach AdamW's working copy (more layouts: bench/plan_cpu.py, docs/benchmarks.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.distributed.conftest import pretrain
from tests.helpers import assert_layout, run_config, summary


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (2, ["parallel.dp=2", "parallel.micro_batch_size=4"]),  # 2 micro-batches: gradients held
        (2, ["parallel.sharding=2", "parallel.sharding_stage=2", "parallel.micro_batch_size=8"]),
    ],
)
def test_planned_peak_memory_matches_each_rank(tiny_data, tmp_path, nproc, overrides):
    from suite.parallel.dims import resolve_dims
    from suite.plan.cost import evaluate
    from suite.plan.fit import recipe_layout
    from suite.plan.layout import Job

    run_dir = pretrain(tmp_path / "run", tiny_data, nproc, *overrides, "train.tensor_memory=true", steps=2)
    assert_layout(run_dir, nproc, overrides)
    measured = summary(run_dir)["tensor_peak_gb_per_rank"]
    cfg = run_config(run_dir)
    job = Job.from_config(cfg)
    job = replace(job, cluster=replace(job.cluster, name="cpu", device_type="cpu", devices_per_node=nproc))
    predicted = evaluate(job, recipe_layout(cfg, resolve_dims(cfg, nproc))).memory.total / 2**30
    assert len(measured) == nproc
    assert max(measured) == pytest.approx(predicted, rel=0.05), (measured, predicted)
