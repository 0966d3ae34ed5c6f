"""Expert parallelism (`parallel.ep`): each rank holds num_experts/ep experts of every MoE layer.

Layout (torchtitan-style: ep borrows ranks from the data-parallel dimension). The data ranks
(dp x sharding, flattened) are cut into groups of `ep` neighbours; inside a group every rank holds a
different slice of the experts, and the groups replicate each other:

    expert mesh ("edp", "ep") = data ranks reshaped to (data/ep, ep), per pipeline stage under pp
    expert weights   DTensor [E, ...] placed (Replicate() over edp, Shard(0) over ep)
    dense weights    the usual data parallel over all data ranks (replicate / FSDP / HSDP)

    with cp > 1: ep groups are data ranks of one cp coordinate, "edp" = (data/ep) x cp replicas
    with tp > 1: mesh ("edp", "ep", "tp"), experts also split on their ffn dim over tp and the
    dispatch wrapped in suite.parallel.expert_tensor_parallel's copy / reduce pair

Each rank routes its own tokens (so routing, capacity dropping and the auxiliary loss are the
single-process ones), then `GroupedExperts.forward(tokens sorted by expert, counts)` is replaced by:
exchange counts (all_to_all), send every token to the rank owning its expert (all_to_all_single
with variable splits, autograd-exact: its backward is the reverse all_to_all), regroup by local
expert, run the local experts, restore the order, send results back (all_to_all_single). That is
the flat dispatch; across nodes `parallel.ep_dispatch` may swap in the two-stage one of
suite.parallel.hierarchical_dispatch, which sends each token once per node.

Gradients: the dispatch backward already sums, on the owning rank, the contributions of every
token of its ep group; after the last micro-batch `reduce_expert_grads` sums them over the edp
replicas and divides by the data-parallel size, the same mean-over-data-ranks that the data-parallel
engine applies to dense gradients. So training matches one process (tests/distributed/test_moe.py).

Offload (`parallel.offload=true`, FSDP stage 2-3): the dense engine leaves the expert weights out,
so `shard_experts` gives each experts module its own FSDP2 group on the expert mesh (torchtitan's
dp_mod_ep), sharded over "edp" (kept whole over "ep", where they already are split) with the same
mixed-precision and CPU offload policies: expert parameters, gradients and AdamW state then live
on the host, 1/edp of this rank's experts each. FSDP's reduce-scatter over edp, divided by the
data-parallel size, then replaces `reduce_expert_grads` (which is not registered).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.moe import (
    GroupedExperts,
    MoEFeedForward,
    expert_ffn_size,
    load_metrics,
    moe_layer_ids,
    run_experts,
)
from suite.parallel.env import node_of
from suite.parallel.expert_tensor_parallel import EXPERT_TP_DIM, TensorParallelExperts

EP_AXES = ("edp", "ep")


def check_expert_parallel(dims, cfg) -> None:
    """One-line ConfigErrors for MoE / ep settings the parallel engine cannot run (before launch)."""
    model, pcfg = cfg.model, cfg.parallel
    ep = dims.ep
    if model.num_experts == 0:
        raise ConfigError(
            f"parallel.ep={ep}: expert parallelism needs a mixture-of-experts model and model.num_experts=0; "
            "set model.num_experts (e.g. recipe=moe-tiny) or use parallel.ep=1"
        )
    if dims.tp > 1 and expert_ffn_size(model) % dims.tp:
        raise ConfigError(
            f"parallel.tp={dims.tp} does not divide the expert MLP width (model.moe_ffn_hidden_size) "
            f"{expert_ffn_size(model)}; tensor parallelism splits every expert on it, use a tp that divides it"
        )
    if ep == 1:
        return
    if model.num_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide model.num_experts={model.num_experts}; each ep rank holds "
            f"num_experts/ep experts, use an ep that divides {model.num_experts}"
        )
    if pcfg.offload and pcfg.ep_dispatch == "hierarchical":
        raise ConfigError(
            "parallel.ep_dispatch=hierarchical with parallel.offload=true is not supported (its dispatch "
            "reads the expert weights outside the FSDP group that gathers them); use parallel.ep_dispatch=flat"
        )
    if dims.data_parallel_size % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the data-parallel ranks (parallel.dp x parallel.sharding = "
            f"{dims.data_parallel_size}); expert parallelism borrows data ranks, use an ep that divides "
            f"{dims.data_parallel_size}"
        )


def expert_rank_grid(dims) -> torch.Tensor:
    """Global ranks [pp, edp, ep, tp]: the ep groups are the rows along dim 2 (see build_expert_mesh)."""
    groups, cp = dims.data_parallel_size // dims.ep, dims.cp
    ranks = torch.arange(dims.world_size).view(dims.pp, groups, dims.ep, cp, dims.tp)
    return ranks.permute(0, 1, 3, 2, 4).reshape(dims.pp, groups * cp, dims.ep, dims.tp)


def build_expert_mesh(dims, device_type: str) -> DeviceMesh:
    """("edp", "ep") mesh over this pipeline stage's data ranks: ep groups are neighbouring data ranks
    (collective). The job's ranks are laid out pp x data x cp x tp, so the ranks of stage s are
    ((s * data + data_rank) * cp + cp_rank) * tp + tp_rank: the full mesh carries a leading "pp"
    axis and this rank keeps the slice of its own stage (each stage has its own expert groups).
    Under cp an ep group joins data ranks of one cp coordinate (they hold the same sequence chunks
    of different samples), and the cp ranks are further replicas: "edp" is (data / ep) x cp.
    With tp > 1 a third, innermost axis "tp": an ep group then joins the ranks of one tp coordinate."""
    ranks = expert_rank_grid(dims)
    names = ("pp", *EP_AXES, "tp")
    if dims.tp == 1:
        ranks, names = ranks[..., 0], names[:-1]
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    return mesh[names[1:]]


def exchange_and_run(
    experts: TensorParallelExperts, x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, size: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rows `x` sorted by expert (`counts`: one per expert of the `size` ranks of `group`, which hold
    equal consecutive slices of them; `experts` holds this rank's slice) to their experts' ranks and
    back: (outputs in x's order, rows sent to each rank, rows received from each). Collective."""
    local_experts = counts.numel() // size
    # how many rows every rank sends to each of my local experts
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    send_matrix = counts.view(size, local_experts)
    recv_matrix = recv_counts.view(size, local_experts)  # [source rank, local expert]
    send_splits = send_matrix.sum(1).tolist()
    recv_splits = recv_matrix.sum(1).tolist()

    received = x.new_empty(sum(recv_splits), x.shape[1])
    received = all_to_all_single(received, x.contiguous(), recv_splits, send_splits, group=group)
    # rows arrive grouped by (source, local expert); the experts want them grouped by local expert
    block = torch.arange(size * local_experts, device=x.device).view(size, local_experts)
    row_key = torch.repeat_interleave(
        (block % local_experts) * size + block // local_experts, recv_matrix.flatten()
    )
    order = torch.argsort(row_key, stable=True)
    w3 = experts.w3.to_local() if experts.w3 is not None else None
    adapters = experts.adapters(local=lambda t: t.to_local())  # LoRA factors: sharded like the weights
    out = run_experts(
        received[order],
        recv_matrix.sum(0),
        experts.w1.to_local(),
        experts.w2.to_local(),
        w3,
        experts.impl,
        adapters,
    )
    out = out[torch.argsort(order)]
    result = x.new_empty(x.shape[0], out.shape[1])
    result = all_to_all_single(result, out.contiguous(), send_splits, recv_splits, group=group)
    return result, send_splits, recv_splits


class ExpertParallelExperts(TensorParallelExperts):
    """GroupedExperts whose stacked weights are sharded over `ep` and whose tokens travel by all_to_all.

    Made by `apply_expert_parallel` from a GroupedExperts (its class is swapped, like FSDP2 does);
    parameter names stay the same, so checkpoints load in any layout. Under tp as well, the
    inherited `forward` wraps this dispatch in the expert-tensor-parallel copy / reduce
    (suite.parallel.expert_tensor_parallel) and the local experts are this rank's ffn slices.
    """

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    ep_nodes: list[int]  # the node of each ep rank (suite.parallel.env.node_of)
    ep_dispatch: str = "flat"
    traffic: dict

    def local_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        result, send_splits, recv_splits = exchange_and_run(self, x, counts, self.ep_group, self.ep_size)
        if self.training:  # training steps only (evaluation forwards are not a step's traffic)
            # forward dispatch + combine, and the backward's reverse exchanges of the same sizes
            row_bytes = 2 * x.shape[1] * x.element_size()
            me, nodes = self.ep_rank, self.ep_nodes
            others = [i for i in range(self.ep_size) if i != me]
            remote = [i for i in others if nodes[i] != nodes[me]]
            self.traffic["bytes"] += row_bytes * sum(send_splits[i] + recv_splits[i] for i in others)
            self.traffic["internode"] += row_bytes * sum(send_splits[i] + recv_splits[i] for i in remote)
        return result


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, traffic: dict) -> list[nn.Parameter]:
    """Shard every MoE layer's experts over `ep` (model on meta); returns the expert parameters
    (the stacked weights and their LoRA factors, lora_a.w1 ...: per expert, so sharded alike).

    `traffic["bytes"]` accumulates the bytes this rank sends to other ranks in training steps, the
    forward dispatch and combine and the backward's reverse exchanges; `traffic["internode"]` the
    part of it sent to ranks on other nodes.
    """
    tp = "tp" in (ep_mesh.mesh_dim_names or ())
    ep_group = ep_mesh.get_group("ep")
    ep_nodes = [node_of(r) for r in dist.get_process_group_ranks(ep_group)]
    traffic.setdefault("bytes", 0)
    traffic.setdefault("internode", 0)
    expert_params: list[nn.Parameter] = []
    for module in list(model.modules()):
        if not isinstance(module, GroupedExperts):
            continue
        for name, param in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            # LoRA factors (lora_a.w1 ...) under tp are refused before launch (suite.finetune.checks)
            placements = [Replicate(), Shard(0)] + ([Shard(EXPERT_TP_DIM[name])] if tp else [])
            # under tp the parameter is already a DTensor on the tp mesh: placed afresh (on meta)
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device) if tp else param.data
            sharded = nn.Parameter(
                distribute_tensor(full, ep_mesh, placements, src_data_rank=None),
                requires_grad=param.requires_grad,  # a LoRA base stays frozen
            )
            setattr(module.get_submodule(owner) if owner else module, leaf, sharded)
            expert_params.append(sharded)
        module.__class__ = ExpertParallelExperts
        module.tp_group = ep_mesh.get_group("tp") if tp else None
        module.ep_group = ep_group
        module.ep_size = ep_mesh.size(1)
        module.ep_rank = ep_mesh.get_local_rank("ep")
        module.ep_nodes = ep_nodes
        module.traffic = traffic
    return expert_params


def shard_experts(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    average_size: int,
) -> None:
    """FSDP2 on every expert-parallel experts module over the "edp" axis of `ep_mesh` (the weights
    are DTensors on it, Replicate over edp): parameters, gradients and optimizer state sharded over
    edp (and offloaded with `offload_policy`). Gradients are reduce-scattered over edp and divided
    by `average_size` (data ranks x cp), the mean the dense engine takes: no reduce hook is needed."""
    # deferred: only torch 2.13's FSDP2 has it (the mesh axis to shard over); the rest of the suite
    # also imports on the older torch of some GPU images (offloaded experts need 2.13, the pin)
    from torch.distributed.fsdp import DataParallelMeshDims

    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            fully_shard(
                module,
                mesh=ep_mesh,
                dp_mesh_dims=DataParallelMeshDims(shard="edp"),
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
            )
            module.set_gradient_divide_factor(float(average_size))
            # a plain sum, then the division: a factor other than the group size would otherwise be
            # NCCL's PREMUL_SUM, which gloo lacks. Not on a 1-rank edp: FSDP then skips the
            # collective and divides by the factor itself (forcing the sum would divide twice)
            module.set_force_sum_reduction_for_comms(ep_mesh.size(0) > 1)


def expert_params_of(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


@torch.no_grad()
def reduce_expert_grads(params: list[nn.Parameter], ep_mesh: DeviceMesh, average_size: int) -> None:
    """Expert gradients: sum over the edp replicas, then divided by `average_size`, the ranks dense
    gradients are averaged over (data ranks x cp: Placement.gradient_average_size)."""
    replicas = ep_mesh.size(0)
    for param in params:
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if replicas > 1:
            dist.all_reduce(local, group=ep_mesh.get_group("edp"))
        local.div_(average_size)


def _stats_by_layer(model: nn.Module, layers: list[int], num_experts: int) -> dict[str, torch.Tensor]:
    """This rank's load sums since the last call, with one token-count row per MoE layer of the whole
    model (`layers`: their ids) and zeros for the layers other pipeline stages hold: summed over
    ranks, every layer's row is its own, as in one process. Zeros where this rank holds none."""
    counts = torch.zeros(len(layers), num_experts, dtype=torch.float64)
    scalars = {
        k: torch.zeros((), dtype=torch.float64) for k in ("balance_loss", "z_loss", "dropped", "calls")
    }
    for name, module in model.named_modules():
        if not isinstance(module, MoEFeedForward):
            continue
        stats = module.pop_stats()
        if stats:
            parts = name.split(".")  # ...layers.<id>.feed_forward
            layer = int(parts[parts.index("layers") + 1])
            counts[layers.index(layer)] += stats["tokens_per_expert"]
            for key in scalars:
                scalars[key] = scalars[key] + stats[key]
    return {"tokens_per_expert": counts, **scalars}


def moe_step_metrics(
    model: nn.Module, cfg: ModelConfig, steps: int, traffic: dict | None
) -> dict[str, float]:
    """Load-balance figures since the last call (all ranks' tokens, every pipeline stage's layers)
    and all-to-all bytes per step; {} when no training forward ran since the last call.

    Collective when distributed: every rank calls it at the same steps. a2a_bytes counts the bytes
    all ranks together send to other ranks per optimizer step, dispatch + combine, forward + backward;
    a2a_internode_bytes the part of them that crosses nodes (0 when every ep group is on one node).
    """
    stats = _stats_by_layer(model, moe_layer_ids(cfg), cfg.num_experts)
    sent = [float(traffic.get(k, 0)) if traffic is not None else 0.0 for k in ("bytes", "internode")]
    if traffic is not None:
        traffic.update(bytes=0, internode=0)
    keys = ("balance_loss", "z_loss", "dropped", "calls")
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([stats["tokens_per_expert"].flatten(), torch.tensor(sent, dtype=torch.float64)])
        flat = torch.cat([flat, torch.stack([stats[key] for key in keys])])
        dist.all_reduce(flat)
        n = stats["tokens_per_expert"].numel()
        stats["tokens_per_expert"] = flat[:n].view_as(stats["tokens_per_expert"])
        sent = [float(flat[n]), float(flat[n + 1])]
        for i, key in enumerate(keys):
            stats[key] = flat[n + 2 + i]
    if not float(stats["calls"]):
        return {}
    metrics = load_metrics(stats, cfg.top_k)
    if traffic is not None:
        metrics["a2a_bytes"] = sent[0] / max(steps, 1)
        metrics["a2a_internode_bytes"] = sent[1] / max(steps, 1)
    return metrics


@torch.no_grad()
def update_expert_bias(model: nn.Module, cfg: ModelConfig) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), after every optimizer step: each MoE layer's
    `expert_bias` moves by model.router_bias_update_rate toward the mean load, up where an expert got
    fewer assignments than the layer's mean since the last update, down where more.

    Collective when distributed: the loads are summed over every rank (data, context, pipeline and
    expert ranks each count their own tokens; tensor-parallel ranks count the same tokens, which
    scales a layer's loads evenly and leaves every sign as it is), so all ranks apply one update."""
    layers = moe_layer_ids(cfg)
    loads = torch.zeros(len(layers), cfg.num_experts, dtype=torch.float64)
    held: dict[int, MoEFeedForward] = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoEFeedForward) or not module.sigmoid:
            continue
        parts = name.split(".")  # ...layers.<id>.feed_forward
        index = layers.index(int(parts[parts.index("layers") + 1]))
        held[index] = module
        if module.load_since_update is not None:
            loads[index] += module.load_since_update
            module.load_since_update = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loads)
    rate = cfg.router_bias_update_rate
    for index, module in held.items():
        load = loads[index]
        module.expert_bias.add_((torch.sign(load.mean() - load) * rate).to(module.expert_bias))
