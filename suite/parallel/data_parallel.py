"""Data parallelism on PyTorch's FSDP2 engine: replication, ZeRO stages 1-3, HSDP, offload.

What each setting means on every rank (P = parameter bytes, N = sharding degree):

    dp only                 `replicate` (FSDP2's DDP): full params, full grads all-reduced, full
                            optimizer state.
    sharding, stage 1       ZeRO-1: `replicate` over all data ranks (full params, full grads
                            all-reduced) + ZeroOneOptimizer: each rank keeps the optimizer state of
                            its 1/N row slice of every parameter, updates that slice, and the slices
                            are all-gathered back into the full parameters after the step.
    sharding, stage 2       FSDP2 `fully_shard(reshard_after_forward=False)`: params sharded at rest,
                            gathered in forward and kept until backward; grads reduce-scattered
                            (sharded); optimizer state sharded.
    sharding, stage 3       FSDP2 `fully_shard(reshard_after_forward=True)`: params re-sharded after
                            each block's forward and gathered again in backward.
    dp > 1 and sharding > 1 HSDP: the same, on the 2-D (dp, sharding) mesh: sharded inside a group of
                            N ranks, replicated across the dp groups (FSDP2's 2-D mesh).
    offload                 FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state live
                            on the CPU, the optimizer steps there. On a CPU-only machine this is the
                            same code path with nothing to move (state already is on the CPU).

Gradients are averaged over the data ranks by the engine, and each micro-batch loss is the mean
over its tokens divided by the number of micro-batches, so the gradient is that of the mean loss
over the global batch: the same as one process.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from suite.models.transformer import Transformer, reset_buffers, rope_inv_freq
from suite.parallel.mesh import data_cp_mesh, data_mesh, fsdp_cp_mesh
from suite.runtime import PrecisionPolicy

WRAPPER_SEGMENTS = re.compile(
    r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module|module)(?=\.|$)"
)


def canonical_name(name: str) -> str:
    """A parameter's name as one process (and every checkpoint) calls it: wrapper segments removed."""
    return WRAPPER_SEGMENTS.sub("", name).lstrip(".")


def mixed_precision(precision: PrecisionPolicy) -> MixedPrecisionPolicy:
    """bf16/fp16 compute and all-gathers, fp32 gradient reduction; fp32 master weights stay sharded.
    (fp16: the loss scaler, suite.train.loss_scale, checks the sharded gradients over every rank.)"""
    if precision.low_precision:
        return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=precision.reduce_dtype)
    return MixedPrecisionPolicy()


def offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def data_parallel_kind(dims, stage: int, offload: bool = False) -> str:
    """none | replicate | zero1 | fsdp | hsdp.

    Context-parallel ranks hold the same parameters and each computes gradients from its part of
    the sequence, so they join the data-parallel ranks in the gradient average (cp alone: replicate).
    A single process that offloads (`offload`, world size 1) is a one-rank FSDP group: FSDP2's
    CPUOffloadPolicy keeps parameters, gradients and AdamW state in host memory between uses.
    """
    if dims.data_parallel_size * dims.cp == 1:
        return "fsdp" if offload and dims.world_size == 1 else "none"
    if dims.sharding == 1:
        return "replicate"
    if stage == 1:
        return "zero1"
    return "hsdp" if dims.dp > 1 else "fsdp"


def apply_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    dims,
    stage: int,
    precision: PrecisionPolicy,
    offload: bool,
    device: torch.device,
    ignored_params: set[nn.Parameter] | None,
    forward_prefetch: int,
    backward_prefetch: int,
) -> str:
    """Wrap `model` (a Transformer or a pipeline part) per block, then the rest; returns the kind.

    `ignored_params` (expert-parallel weights) are left out: their own module reduces them.
    `forward_prefetch` / `backward_prefetch` (parallel.fsdp_forward_prefetch / fsdp_backward_prefetch,
    FSDP2 stages 2-3 only): how many following blocks each block's forward (backward) starts
    all-gathering ahead. 0 forward / 1 backward are FSDP2's own implicit behaviour; more overlaps
    more communication with compute and holds that many more blocks' parameters whole.
    """
    kind = data_parallel_kind(dims, stage, offload)
    if kind == "none":
        return kind
    mp = mixed_precision(precision)
    off = offload_policy(offload, device)
    if ignored_params:
        mp_off = dict(mp_policy=mp, offload_policy=off, ignored_params=ignored_params)
    else:
        mp_off = dict(mp_policy=mp, offload_policy=off)
    blocks = list(model.layers.values())
    if kind in ("replicate", "zero1"):
        # zero1 replicates over every data rank; the optimizer does the sharding
        if dims.cp > 1:
            data = data_cp_mesh(mesh)  # dp x sharding x cp (sharding is 1 for replicate)
        else:
            data = mesh["dp"] if kind == "replicate" else data_mesh(mesh)
        for block in blocks:
            replicate(block, mesh=data, **mp_off)
        replicate(model, mesh=data, **mp_off)
        return kind
    if dims.cp > 1:  # cp ranks join the sharding group (torchtitan's dp_shard_cp)
        shard_mesh = fsdp_cp_mesh(mesh)
    else:
        shard_mesh = mesh["dp", "sharding"] if kind == "hsdp" else mesh["sharding"]
    after_forward = stage == 3
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, reshard_after_forward=after_forward, **mp_off)
    # the root group (embeddings, final norm, head): at stage 3 it is re-sharded after forward too
    # (FSDP2's default would keep the root gathered), so no parameter stays whole between passes
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=after_forward, **mp_off)
    set_fsdp_prefetch(blocks, forward_prefetch, backward_prefetch)
    return kind


def set_fsdp_prefetch(blocks: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetching: block i gathers blocks i+1..i+forward during its forward and
    blocks i-1..i-backward during its backward (1 backward is FSDP2's implicit default)."""
    for i, block in enumerate(blocks):
        if forward > 0 and blocks[i + 1 : i + 1 + forward]:
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward])
        if backward > 1 and i > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward) : i][::-1])


def set_gradient_sync(model: nn.Module, kind: str, last_micro_batch: bool) -> None:
    """Communicate gradients once per optimizer step where that saves traffic and no memory.

    replicate / zero1: skip the all-reduce until the last micro-batch (like DDP's no_sync).
    hsdp: reduce-scatter every micro-batch (grads stay sharded), all-reduce across dp once.
    fsdp: reduce-scatter every micro-batch (keeping unsharded grads would cost memory).
    """
    if not isinstance(model, FSDPModule):
        return
    if kind in ("replicate", "zero1"):
        model.set_requires_gradient_sync(last_micro_batch)
    elif kind == "hsdp":
        model.set_requires_all_reduce(last_micro_batch)


# ---- seeded init of sharded parameters ------------------------------------------------------------
class _OneParameter:
    """Lets Transformer.init_weights fill one full tensor: the same values one process gets."""

    def __init__(self, cfg, name: str, tensor: torch.Tensor):
        self.cfg, self._item, self.rope_inv_freq = cfg, (name, tensor), None

    def named_parameters(self):
        yield self._item


def full_init(model_cfg, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`, computed on the CPU."""
    tensor = torch.empty(shape)
    Transformer.init_weights(_OneParameter(model_cfg, name, tensor), seed)
    return tensor


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` laid out as `like` (a DTensor or a plain tensor)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def materialize_parallel(
    model: nn.Module, device: torch.device, seed: int, buffer_device: torch.device | None = None
) -> nn.Module:
    """Allocate a parallelized meta model on `device` and give every shard its single-process value.

    Each parameter's full value is computed from (seed, name) one tensor at a time on the CPU, and
    only this rank's piece is kept, so peak extra memory is one full parameter. Buffers (the RoPE
    table) go to `buffer_device`, the compute device, when the parameters live elsewhere (offload).
    """
    cfg = model.cfg
    model.to_empty(device=device)
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if cfg.tie_embeddings and emb is not None and out is not None and out.weight is not emb.weight:
        if isinstance(model, FSDPModule):
            raise RuntimeError("tied embeddings came apart while materialising an FSDP model")
        out.weight = emb.weight
    for name, param in model.named_parameters():
        full = full_init(cfg, canonical_name(name), param.shape, seed)
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(local_part(full, param).to(target.dtype))
    if getattr(model, "rope_inv_freq", None) is not None:
        model.rope_inv_freq.copy_(rope_inv_freq(cfg).to(model.rope_inv_freq.device))
    reset_buffers(model)
    if buffer_device is not None and buffer_device != device:
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(buffer_device)
    return model


# ---- gradient norm and clipping across shards -------------------------------------------------------
def _spec_key(t: torch.Tensor):
    if isinstance(t, DTensor):
        return ("dtensor", t.device_mesh, t.placements, t.device)
    return ("plain", t.device)


def _fp32_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`, accumulated in fp32 whatever their dtype: a bf16 norm (what torch's
    foreach norm returns for bf16 gradients) is rounded to 8 bits, and so is every clipping coefficient."""
    if all(g.dtype == torch.float32 for g in grads):
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def total_grad_norm(params, extra_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global 2-norm of all gradients: each distinct gradient element counted once.

    DTensor gradients are grouped by layout; each group's norm is resolved over its mesh
    (summing shard contributions, counting replicas once). `extra_group` (the pipeline axis)
    sums contributions of parameters that live on different ranks entirely.
    """
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[_spec_key(p.grad)].append(p.grad)
    device = next(iter(groups))[-1] if groups else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in groups.values():
        norm = _fp32_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().to(device) ** 2
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        dist.all_reduce(total_sq, group=extra_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, extra_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """DTensor-aware `clip_grad_norm_`; returns the total norm (before clipping)."""
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, extra_group)
    if max_norm > 0:
        groups: dict = defaultdict(list)
        for p in params:
            groups[_spec_key(p.grad)].append(p)
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(
                members, max_norm, total.to(members[0].grad.device), foreach=True
            )
    return total
