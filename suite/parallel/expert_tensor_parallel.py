"""Tensor parallelism of Mixture-of-Experts layers: expert-tensor-parallel (Megatron-Core's ETP = TP).

Inside an MoE layer under `parallel.tp`:

    router                  replicated (a Replicate DTensor): every tp rank routes the same, whole
                            set of tokens, so routing, capacity dropping and the balance / z-losses
                            are the single process's, computed identically on each tp rank
    experts.w1 / w3         [E, ffn, h] split on ffn (Shard(1)): column-parallel per expert
    experts.w2              [E, h, ffn] split on ffn (Shard(2)): row-parallel per expert
    shared_experts          a dense MLP: ColwiseParallel / RowwiseParallel, as for dense blocks

The experts' input enters through `copy_to_tp` (identity forward, all-reduce of the gradient
backward) and their output leaves through `reduce_from_tp` (all-reduce forward, identity backward):
Megatron's pair of conjugate operators around a column-then-row-parallel MLP. The reduce sits on
the routed rows, before they are weighted by the router's probabilities and scattered back to
their tokens, so everything after it (the weighting, the combine, the router's gradient) is
replicated and exact on every tp rank; the price is top_k x tokens x hidden per reduce instead of
tokens x hidden. With `parallel.ep` the same pair wraps the all-to-all dispatch: tokens travel
among the ranks of one tp coordinate, and the partial sums are reduced after they come back.

With sequence parallelism (`parallel.sp`) the layer's input arrives as this rank's sequence slice:
it is all-gathered (the router needs every token of the micro-batch to route as one process does),
and the output, replicated after the reduce, keeps only this rank's slice (backward: all-gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from suite.models.family import family_of
from suite.models.moe import GroupedExperts, MoEFeedForward, run_experts
from suite.parallel.tp_styles import Replicated

# tp placement of each stacked expert weight: the ffn dimension
EXPERT_TP_DIM = {"w1": 1, "w3": 1, "w2": 2}


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of the tp ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (partial sums -> whole); backward identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class TensorParallelExperts(GroupedExperts):
    """GroupedExperts whose weights are split on the ffn dim across tp (class swapped in place, names
    kept, so checkpoints load in any layout). `tp_group` None: no tensor parallelism (ep only)."""

    tp_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group)
        return reduce_from_tp(self.local_forward(x, counts), self.tp_group)

    def local_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the experts' outputs for rows sorted by expert."""
        return run_experts(x, counts, local(self.w1), local(self.w2), local(self.w3), self.impl)


def shared_expert_plan(cfg) -> dict:
    """The dense shared experts' styles (output replicated: the layer's output is assembled whole)."""
    if not family_of(cfg).swiglu:
        up = ["shared_experts.w1"]
    elif cfg.fused_projections:
        up = ["shared_experts.w13"]
    else:
        up = ["shared_experts.w1", "shared_experts.w3"]
    return {**{key: ColwiseParallel() for key in up}, "shared_experts.w2": RowwiseParallel()}


def apply_expert_tensor_parallel(moe: MoEFeedForward, tp_mesh: DeviceMesh, sp: bool, cfg) -> None:
    """Rewrite one MoE layer (on meta) for tp = tp_mesh.size(), as the module docstring lays out."""
    parallelize_module(moe, tp_mesh, {"router": Replicated()})
    if moe.shared_experts is not None:
        parallelize_module(moe, tp_mesh, shared_expert_plan(cfg))
    experts = moe.experts
    for name, dim in EXPERT_TP_DIM.items():
        param = getattr(experts, name)
        if param is not None:
            dt = distribute_tensor(param.data, tp_mesh, [Shard(dim)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(dt, requires_grad=param.requires_grad))
    experts.__class__ = TensorParallelExperts
    experts.tp_group = tp_mesh.get_group()
    if sp:
        _gather_sequence(moe, tp_mesh)


def _gather_sequence(moe: nn.Module, tp_mesh: DeviceMesh) -> None:
    """sp: the layer sees the whole sequence and hands back this rank's slice of its output."""

    def gather(mod, inputs):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
        # every rank ends with the same whole gradient (see the module docstring): slicing it back
        # to Shard(1) is the exact backward
        return (x.redistribute(tp_mesh, [Replicate()]).to_local(), *inputs[1:])

    def scatter(mod, inputs, output):
        whole = DTensor.from_local(output, tp_mesh, [Replicate()], run_check=False)
        return whole.redistribute(tp_mesh, [Shard(1)]).to_local()

    moe.register_forward_pre_hook(gather)
    moe.register_forward_hook(scatter)
