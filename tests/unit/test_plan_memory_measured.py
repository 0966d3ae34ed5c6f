"""The planner's per-rank peak memory against the trainer's own step, measured in-process.

suite.train.tensor_memory counts the live tensor storages of one training step (the trainer's step
from suite.train.trainer.standalone_step: parameters, AdamW state, gradients, activations, the loss
head); suite.plan.cost.evaluate predicts the same peak for one process. The cases cover the two
phases of the peak (backward with several micro-batches, where earlier gradients are held, and one
micro-batch, where they are not yet) and both loss heads (plain F.cross_entropy, and the chunked
head of suite.train.loss). Multi-rank layouts: bench/plan_cpu.py, docs/benchmarks.md.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from suite.config.compose import compose_config, to_object
from suite.data.batch import Batch
from suite.plan.cost import evaluate
from suite.plan.fit import recipe_layout
from suite.plan.layout import Job
from suite.plan.params import count_params
from suite.preflight import validate
from suite.train.tensor_memory import TensorMemory
from suite.train.trainer import standalone_step

SHAPE = [
    "recipe=gpt-tiny",
    "model.num_layers=2",
    "model.hidden_size=128",
    "model.num_heads=4",
    "model.vocab_size=4096",
    "data.seq_len=64",
    "train.precision=fp32",
    "train.compile=false",
    "train.device=cpu",
    "cluster=cpu",
]


def measured_and_predicted(*overrides: str) -> tuple[int, float, int]:
    """(measured peak bytes of the second step, the planner's, the bytes alive at its start), less
    what earlier tests in this process left alive (the tracker finds every live tensor)."""
    gc.collect()
    with TensorMemory(torch.device("cpu")) as before:
        baseline = before.peak
    cfg = to_object(compose_config([*SHAPE, *overrides]))
    dims = validate(cfg, needs_data=False)
    step = standalone_step(cfg, dims, torch.device("cpu"))
    micro, seq = cfg.parallel.micro_batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(0)
    batches = [
        Batch.from_windows(torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen))
        for _ in range(dims.accumulation(cfg.parallel))
    ]
    step(batches, 1e-3)  # the first step creates AdamW's state
    tracker = TensorMemory(torch.device("cpu"))
    with tracker:
        start = tracker.peak
        step(batches, 1e-3)
    job = Job.from_config(cfg)
    job = replace(job, cluster=replace(job.cluster, nodes=1, devices_per_node=1))
    predicted = evaluate(job, recipe_layout(cfg, dims)).memory.total
    return tracker.peak - baseline, predicted, start - baseline


@pytest.mark.parametrize(
    "overrides",
    [
        # 4 micro-batches of 2 x 64 tokens: plain loss; the peak is in backward, gradients held
        ("parallel.micro_batch_size=2", "parallel.global_batch_size=8"),
        # one micro-batch: the gradients come as the activations go
        ("parallel.micro_batch_size=4", "parallel.global_batch_size=4"),
        # 256 tokens in chunks of 64: the chunked head's accumulated weight gradient
        ("parallel.micro_batch_size=4", "parallel.global_batch_size=8", "train.loss_chunk_tokens=64"),
    ],
)
def test_planned_peak_memory_is_the_measured_one(overrides):
    measured, predicted, start = measured_and_predicted(*overrides)
    params = count_params(to_object(compose_config(SHAPE)).model)
    # the tracker found what was alive when it began: fp32 parameters and AdamW's two moments (the
    # gradients were set to None by the last step), and little else
    assert 12 * params <= start <= 1.05 * 12 * params, (start, params)
    assert predicted == pytest.approx(measured, rel=0.05), (predicted, measured)
