"""The cost model against published runs: Narayanan et al. 2021, Table 2 (suite/plan/published.py
says how each system maps onto a layout). One compute efficiency and one network efficiency per
cluster preset, the same for every row (docs/planner.md)."""

from __future__ import annotations

import pytest

from suite.config.compose import compose_config, to_object
from suite.plan.cost import evaluate
from suite.plan.layout import check_layout
from suite.plan.published import NARAYANAN_2021_TABLE_2, job_of
from suite.plan.search import search


def _cluster(name: str):
    return to_object(compose_config([f"cluster={name}"])).cluster


@pytest.mark.parametrize("cluster", ["a100-40g", "a100-80g"])  # the same compute and links: the same times
@pytest.mark.parametrize("run", NARAYANAN_2021_TABLE_2, ids=lambda r: f"{r.system}-{r.model}-{r.gpus}")
def test_published_throughput_within_20_percent(run, cluster):
    job = job_of(run, _cluster(cluster))
    check_layout(job, run.layout)
    predicted = evaluate(job, run.layout).tflops_per_device
    assert abs(predicted / run.tflops_per_gpu - 1) < 0.20, (predicted, run.tflops_per_gpu)


def test_zero3_falls_with_scale_as_published():
    runs = [r for r in NARAYANAN_2021_TABLE_2 if r.system == "ZeRO-3"]
    cluster = _cluster("a100-80g")
    predicted = [evaluate(job_of(r, cluster), r.layout).tflops_per_device for r in runs]
    assert predicted[0] > predicted[1] > predicted[2]
    assert predicted[2] < 0.4 * predicted[0]  # published: 44 / 144 = 0.31
    ptdp = [evaluate(job_of(r, cluster), r.layout).tflops_per_device for r in NARAYANAN_2021_TABLE_2[:3]]
    assert ptdp[2] > 0.85 * ptdp[0]  # while PTD-P keeps most of it (published: 141 / 153 = 0.92)


def test_published_layouts_fit_the_80gb_nodes():
    cluster = _cluster("a100-80g")
    for run in NARAYANAN_2021_TABLE_2:
        assert evaluate(job_of(run, cluster), run.layout).memory.fits, run


@pytest.mark.slow  # one full search over 384 GPUs (~20 s here)
def test_planner_choice_is_at_least_as_fast_as_the_published_layout():
    run = NARAYANAN_2021_TABLE_2[0]  # 175B on 384 GPUs; bench/plan_validation.py runs every row
    job = job_of(run, _cluster("a100-80g"))
    result = search(job)
    published = evaluate(job, run.layout)
    assert result.best.time.total <= published.time.total
    zero3 = evaluate(job, NARAYANAN_2021_TABLE_2[6].layout)  # the same model and GPU count
    assert result.best.time.total <= zero3.time.total
