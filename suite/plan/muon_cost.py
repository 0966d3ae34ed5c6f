"""optim=muon in the planner: which tensors are Muon's (suite.train.muon.is_muon_param, by name and
shape), the state they hold, and the work and communication of their orthogonalisation.

- state: one fp32 momentum buffer per Muon weight instead of AdamW's two moments (4 bytes less per
  weight), sharded like the rest of the optimizer state.
- Newton-Schulz: per iteration 4 m^2 n + 2 m^3 FLOPs for an m x n matrix (m <= n: the Gram matrix,
  its square, the product with the matrix), `optim.muon_ns_steps` iterations, per expert for stacked
  experts, at the `optim.muon_ns_dtype` peak. Under sharding (or tp) each matrix is orthogonalised
  whole, once in its sharding (tp) group (round-robin), so a rank does 1/N of them; replicated
  (dp), every rank does all. Expert stacks (without tp) are split by whole experts over ep (or the
  sharding ranks at ep = 1): each rank orthogonalises its own, with no communication.
- communication (sharding or tp, dense and tp-split matrices): each owner gathers the other ranks' parts of its matrices (fp32)
  and scatters the result back (ns dtype). Per rank that is an all-to-all of its parts of the Muon
  weights, each way; each matrix is its own gather and scatter, so the latency is paid per matrix.
"""

from __future__ import annotations

import math

from suite.plan import comm
from suite.plan.layout import BYTES, Job, Layout
from suite.plan.params import ParamSpec, local_shape, rank_numel, stage_specs
from suite.train.muon import is_muon_param

MOMENTUM_BYTES = 4  # Muon's fp32 momentum buffer, where AdamW holds two moments (8 bytes)


def muon_specs(job: Job, layout: Layout, pp_rank: int) -> list[ParamSpec]:
    """The Muon tensors of pipeline rank `pp_rank` (none under AdamW)."""
    if job.muon is None:
        return []
    specs = stage_specs(job.model, layout.pp, layout.vpp)[pp_rank]
    return [s for s in specs if is_muon_param(s.name, len(s.shape), list(job.muon.exclude))]


def muon_state_saved(job: Job, layout: Layout, pp_rank: int) -> int:
    """Bytes of optimizer state the rank does not hold because Muon keeps one buffer, not two."""
    specs = muon_specs(job, layout, pp_rank)
    shards = layout.sharding if layout.sharding > 1 else 1
    held = (
        rank_numel(specs, layout.tp, layout.ep, shards, 0)
        if shards > 1
        else rank_numel(specs, layout.tp, layout.ep)
    )
    return held * (8 - MOMENTUM_BYTES)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of one orthogonalisation (module docstring); a 3-D stack is one matrix per expert."""
    stack = math.prod(shape[:-2])
    m, n = sorted(shape[-2:])
    return stack * steps * (4 * m * m * n + 2 * m**3)


def muon_time(job: Job, layout: Layout, pp_rank: int) -> float:
    """Seconds per step of the worst rank's Newton-Schulz share and its gather/scatter (sharding or
    tp: the axis its matrices are split over; Muon refuses the two together). Expert stacks outside
    tp are split by whole experts (ep, or FSDP2's / ZeRO-1's rows at ep = 1): each rank does its own
    experts, with no communication."""
    specs = muon_specs(job, layout, pp_rank)
    if not specs:
        return 0.0
    assert job.muon is not None
    c = job.cluster
    speed = c.peak_flops[job.muon.ns_dtype] * c.compute_efficiency
    local = [s for s in specs if s.expert and layout.tp == 1]
    dealt = [s for s in specs if not (s.expert and layout.tp == 1)]
    # this rank's experts; at ep = 1 sharding cuts the stack by experts too (rank_numel's rule)
    cut = layout.sharding if layout.ep == 1 else 1
    flops = sum(newton_schulz_flops(local_shape(s, 1, layout.ep), job.muon.ns_steps) for s in local)
    seconds = flops / cut / speed
    # whole matrices (a tp-split one, experts included, is gathered whole), dealt round-robin
    flops = sum(newton_schulz_flops(local_shape(s, 1, layout.ep), job.muon.ns_steps) for s in dealt)
    axis, ranks = ("sharding", layout.sharding) if layout.sharding > 1 else ("tp", layout.tp)
    seconds += flops / ranks / speed
    if ranks == 1 or not dealt:
        return seconds
    link = comm.group_link(c, layout, axis)
    held = rank_numel(dealt, layout.tp, layout.ep, layout.sharding, 0)  # this rank's parts of them
    for nbytes in (4, BYTES[job.muon.ns_dtype]):  # gather the fp32 update, scatter the result
        seconds += comm.all_to_all(link, held * nbytes)
        seconds += (len(dealt) - 1) * (ranks - 1) * link.latency  # one collective per matrix
    return seconds
