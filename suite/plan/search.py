"""Every valid layout of a job's world size, costed and ranked.

The space (all of it, no sampling): tp up to a node (sequence parallel on whenever tp > 1: the same
traffic, less memory), pp dividing the layers with 1F1B, interleaved 1F1B (v = 2, 4) and zero-bubble
(v = 2), cp (with or without pp; MoE: dropless only), ep for MoE models, the data ranks as replicas, as one
sharding group at ZeRO stage 1, 2 or 3 (stage 3 also offloaded), or as HSDP (sharded inside a node,
replicated across nodes), micro-batches of 1 to 16 sequences, and each recompute granularity. What
the trainer would refuse is dropped (suite.plan.layout.check_layout), then what does not fit in
memory (the device's, or for offload the node's host memory: suite.plan.cost.Memory.fits); the rest is
ranked by step time, then by memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from suite.config.errors import ConfigError
from suite.plan.cost import Cost, evaluate
from suite.plan.layout import Job, Layout, check_layout

MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE = ("none", "core_attn", "full_attn", "full")
CP_DEGREES = (1, 2, 4, 8)
TIME_RESOLUTION = 1.001  # step times within 0.1% of each other rank as equal


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_splits(data: int, per_node: int, offload: bool = True) -> Iterator[dict]:
    """How `data` ranks share the model state: replicas, one sharding group (ZeRO 1/2/3, offload),
    or HSDP with a sharding group of the ranks inside a node (`per_node` of them)."""
    yield {"dp": data}
    if data == 1:
        return
    for stage in (1, 2, 3):
        yield {"sharding": data, "stage": stage}
    if offload:
        yield {"sharding": data, "stage": 3, "offload": True}
    if 1 < per_node < data and data % per_node == 0:
        yield {"dp": data // per_node, "sharding": per_node, "stage": 3}


def _schedules(pp: int, layers: int) -> Iterator[dict]:
    if pp == 1:
        yield {}
        return
    yield {"schedule": "1f1b"}
    for vpp in (2, 4):
        if layers % (pp * vpp) == 0:
            yield {"schedule": "interleaved_1f1b", "vpp": vpp}
    if layers % (pp * 2) == 0:
        yield {"schedule": "zero_bubble", "vpp": 2}


def candidates(
    job: Job, recompute: tuple[str, ...] = RECOMPUTE, micro_batches=MICRO_BATCHES
) -> Iterator[Layout]:
    """Every layout of the space in the module docstring (not yet checked)."""
    m, world, per_node = job.model, job.world, job.cluster.devices_per_node
    offload = job.cluster.device_type != "cpu"  # a CPU has no other memory to offload to
    for tp in divisors(world):
        if tp > per_node:
            break
        for pp in divisors(world // tp):
            if pp > m.num_layers:
                break
            for cp in CP_DEGREES:
                if (world // tp // pp) % cp:
                    continue
                data = world // (tp * pp * cp)
                eps = [e for e in divisors(data) if m.num_experts % e == 0] if m.num_experts else [1]
                for split in _data_splits(data, max(1, per_node // (tp * cp)), offload):
                    for ep in eps:
                        for sched in _schedules(pp, m.num_layers):
                            for mb in micro_batches:
                                if job.global_batch % (mb * data):
                                    continue
                                for rc in recompute:
                                    yield Layout(
                                        tp=tp, sp=tp > 1, pp=pp, cp=cp, ep=ep, micro_batch=mb, recompute=rc,
                                        **split, **sched,
                                    )  # fmt: skip


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Cost]  # layouts that fit, fastest first
    too_big: list[Cost]  # valid layouts that do not fit, least memory first
    invalid: int  # layouts the trainer would refuse

    @property
    def best(self) -> Cost | None:
        return self.ranked[0] if self.ranked else None


def search(job: Job, **space) -> SearchResult:
    """Cost every valid candidate; rank those that fit by step time (then memory)."""
    fits, too_big, invalid = [], [], 0
    for layout in candidates(job, **space):
        try:
            check_layout(job, layout)
        except ConfigError:
            invalid += 1
            continue
        cost = evaluate(job, layout)
        (fits if cost.memory.fits else too_big).append(cost)
    fits.sort(key=_rank_key)
    too_big.sort(key=lambda c: c.memory.total)
    return SearchResult(fits, too_big, invalid)


def _rank_key(cost: Cost) -> tuple:
    """Step time (to 0.1%), then the simpler layout (fewer features switched on), then memory."""
    layout = cost.layout
    features = (
        layout.offload, layout.sharding > 1, layout.stage == 3, layout.tp > 1, layout.pp > 1, layout.vpp > 1,
        layout.cp > 1, layout.ep > 1, layout.recompute != "none",
    )  # fmt: skip
    return (round(math.log(cost.time.total) / math.log(TIME_RESOLUTION)), sum(features), cost.memory.total)


def smallest_cluster(job: Job, max_nodes: int = 4096) -> int | None:
    """The fewest nodes (doubling) on which some layout fits, searching only the leanest layouts
    (micro-batch 1, full recompute); None beyond `max_nodes`."""
    nodes = 1
    while nodes <= max_nodes:
        trial = replace(job, cluster=replace(job.cluster, nodes=nodes))
        if search(trial, recompute=("full",), micro_batches=(1,)).ranked:
            return nodes
        nodes *= 2
    return None
