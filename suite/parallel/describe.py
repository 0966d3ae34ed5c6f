"""What each rank actually holds after `parallelize`, read off the model rather than off the recipe.

The trainer writes this to summary.json (`layout`), so a test (or a person) can check that the
layout asked for is the one that ran: which parameters are DTensors on which mesh axes, which
modules FSDP / replicate wrapped, which blocks recompute or compile, which layers each pipeline
stage holds. A plan that silently skipped a module would show up here as a plain parameter.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

_LAYER = re.compile(r"^layers\.(\d+)\.")


def placement_of(param) -> str:
    """`axis:Placement` for each mesh axis of a DTensor (joined by ','); `local` for a plain tensor."""
    spec = getattr(param, "placements", None)
    if spec is None:
        return "local"
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(len(spec)))
    return ",".join(f"{axis}:{placement!r}" for axis, placement in zip(names, spec))


def _offloaded(module: nn.Module) -> bool:
    """Whether FSDP2 keeps this module's parameter group on the host (CPUOffloadPolicy)."""
    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None) or []  # torch 2.13: a list
    if not groups and getattr(state, "_fsdp_param_group", None) is not None:  # older torch: one group
        groups = [state._fsdp_param_group]
    return any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)


def _generic(name: str) -> str:
    return _LAYER.sub("layers.*.", name)


def describe_rank(model: nn.Module) -> dict:
    """This rank's view: layers held, placement per parameter (layer index folded to `*` where all
    held layers agree), and the wrappers found on modules."""
    layers = sorted(int(k) for k in getattr(model, "layers", {}))
    params: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        params.setdefault(_generic(name), set()).add(placement_of(param))
    wrappers: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        kinds = []
        mro = {cls.__name__ for cls in type(module).__mro__}
        if "ReplicateModule" in mro:  # replicate is built on FSDP2: check it first
            kinds.append("replicate")
        elif "FSDPModule" in mro:
            kinds.append("fsdp")
            if _offloaded(module):
                kinds.append("fsdp_offload")
        if getattr(module, "_suite_recompute", None):  # suite.parallel.recompute's mark
            kinds.append(f"recompute:{module._suite_recompute}")
        if getattr(module, "_compiled_call_impl", None) is not None:
            kinds.append("compiled")
        if "ExpertParallelExperts" in mro:
            kinds.append("expert_parallel")
            if (
                getattr(module, "ep_dispatch", "flat") == "hierarchical"
            ):  # suite.parallel.hierarchical_dispatch
                kinds.append("hierarchical_dispatch")
        if getattr(module, "tp_group", None) is not None:  # suite.parallel.expert_tensor_parallel
            kinds.append("expert_tensor_parallel")
        if type(module).__name__ == "ContextParallelAttention":
            kinds.append("context_parallel")
        if getattr(module, "sum_router_stats", None) is not None:  # suite.parallel.context_parallel_moe
            kinds.append("context_parallel_moe")
        for kind in kinds:
            wrappers.setdefault(kind, []).append(name or "<root>")
    return {
        "layers": layers,
        "params": {k: "|".join(sorted(v)) for k, v in sorted(params.items())},
        "modules": {k: sorted(set(v)) for k, v in sorted(wrappers.items())},
    }


def describe_layout(model: nn.Module, dims, dp_kind: str, extra: dict | None = None) -> dict:
    """Every rank's `describe_rank`, grouped (identical views share one entry with their ranks).
    Collective when distributed; every rank gets the same answer."""
    mine = describe_rank(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    views: list = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(views, mine)
    else:
        views = [mine]
    groups: list[dict] = []
    for rank, view in enumerate(views):
        for group in groups:
            if group["view"] == view:
                group["ranks"].append(rank)
                break
        else:
            groups.append({"ranks": [rank], "view": view})
    return {
        "world_size": world,
        "degrees": dict(dims.enabled),
        "data_parallel": dp_kind,
        **(extra or {}),
        "ranks": [{"ranks": g["ranks"], **g["view"]} for g in groups],
    }
