"""Bytes of model state per rank: weights, gradients, optimizer state, under replication, ZeRO 1-3
(Rajbhandari et al. 2020: 2Ψ + 2Ψ + KΨ for mixed-precision Adam, sharded over N_d by stage) as
suite.parallel.data_parallel runs them, and with offload.

With P the worst pipeline rank's tp/ep-local parameters and P_s what it keeps when sharded
(suite.plan.params.worst_rank_params), p the parameter bytes (train.param_dtype), c the compute
bytes (train.precision), AdamW 8 bytes (two fp32 moments) + 4 for an fp32 master copy of bf16
parameters:

    dp only (replicate)  weights P p, gradients P p, optimizer P (8 + master), and the unsharded
                         compute copies P p kept from forward to backward (torch's `replicate` is
                         FSDP2 over a one-rank shard group: it gathers into separate parameters)
    sharding stage 1     optimizer P_s (8 + master); weights and gradients whole (ZeRO-1; replicate's
                         copies as above)
    sharding stage 2     weights P_s p at rest, gradients P_s p, optimizer P_s (8 + master), and the
                         gathered compute copies P c kept from forward to backward
    sharding stage 3     as stage 2, but only two blocks' compute copies exist at once (the block
                         running and the one prefetched)
    offload              weights, gradients and optimizer state at rest live in host memory
    autocast             low-precision compute over fp32 parameters without FSDP keeps a compute
                         copy of every weight for backward: P c
    optim=muon           the Muon weights hold one fp32 momentum buffer, not two moments: 4 bytes
                         fewer each, sharded as above (suite.plan.muon_cost)
    foreach AdamW        (CPU with DTensor parameters, or optim.fused=false) allocates the update's
                         denominator sqrt(v) for every updated parameter at once: 4 bytes each, in
                         the optimizer step only (suite.train.optim.build_optimizer decides fused)
"""

from __future__ import annotations

from dataclasses import dataclass

from suite.plan.layout import Job, Layout
from suite.plan.muon_cost import muon_state_saved
from suite.plan.params import RankParams, layer_specs, local_shape, worst_rank_params

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # fp32 master weights of bf16 parameters (suite.train.master_weights)


@dataclass(frozen=True)
class StateBytes:
    """Device bytes of model state on the worst rank (host bytes apart, for offload)."""

    weights: float
    compute_copies: float  # gathered (FSDP) or autocast copies in the compute dtype
    gradients: float
    optimizer: float
    host: float  # offloaded to host memory (not counted against the device)
    optimizer_work: float = 0.0  # foreach AdamW's working copy, alive in the optimizer step only

    @property
    def total(self) -> float:
        return self.weights + self.compute_copies + self.gradients + self.optimizer


def rank_params(job: Job, layout: Layout) -> RankParams:
    """The worst pipeline rank's parameters for this layout (exact; suite.plan.params)."""
    shards = layout.sharding if layout.sharding > 1 else 1
    return worst_rank_params(job.model, layout.pp, layout.vpp, layout.tp, layout.ep, shards)


def state_bytes(job: Job, layout: Layout, params: RankParams | None = None) -> StateBytes:
    """Weights, compute copies, gradients and optimizer state of the worst rank (module docstring)."""
    params = params or rank_params(job, layout)
    p, c = job.param_bytes, job.compute_bytes
    per_opt = ADAM_STATE_BYTES + (MASTER_BYTES if p < 4 else 0)
    full, sharded = params.unsharded, params.sharded
    sharding = layout.sharding > 1
    stage = layout.stage if sharding else 0
    weights = (sharded if stage >= 2 else full) * p
    gradients = (sharded if stage >= 2 else full) * p
    optimizer = (sharded if stage >= 1 else full) * per_opt
    optimizer -= muon_state_saved(job, layout, params.pp_rank)
    low = c < p
    if stage == 2:
        copies = full * c
    elif stage == 3:
        copies = 2 * block_params(job, layout) * c
    else:
        copies = full * c if low else 0.0
        if layout.data_ranks * layout.cp > 1:  # replicate: FSDP2's unsharded parameters
            copies += full * p
    work = (sharded if stage >= 1 else full) * 4 if foreach_adamw(job, layout) else 0.0
    host = 0.0
    if layout.offload and job.cluster.device_type != "cpu":  # a CPU's host memory is its memory
        host = weights + gradients + optimizer
        weights = gradients = optimizer = work = 0.0
    return StateBytes(weights, copies, gradients, optimizer, host, work)


def foreach_adamw(job: Job, layout: Layout) -> bool:
    """Whether the trainer's AdamW is the foreach one (suite.train.optim.build_optimizer): fused on
    CUDA and on CPU with plain parameters (one process, or pipeline stages alone), unless
    optim.fused says otherwise."""
    if job.fused_adamw is not None:
        return not job.fused_adamw
    plain = layout.data_ranks * layout.cp * layout.tp * layout.ep == 1
    return job.cluster.device_type == "cpu" and not plain


_BLOCKS: dict[tuple, int] = {}


def block_params(job: Job, layout: Layout) -> int:
    """tp/ep-local parameters of the largest block (what one FSDP unit gathers)."""
    key = (repr(job.model), layout.tp, layout.ep)
    if key not in _BLOCKS:
        _BLOCKS[key] = _largest_block(job, layout)
    return _BLOCKS[key]


def _largest_block(job: Job, layout: Layout) -> int:
    best = 0
    for layer in {0, job.model.num_layers - 1}:
        total = 0
        for spec in layer_specs(job.model, layer):
            shape = local_shape(spec, layout.tp, layout.ep)
            n = 1
            for d in shape:
                n *= d
            total += n
        best = max(best, total)
    return best
