"""Hierarchical (topology-aware) all-to-all for expert parallelism across nodes (`parallel.ep_dispatch`).

The flat dispatch (suite.parallel.expert_parallel) sends one row per (token, expert) straight to
the expert's rank: with top-k routing a token whose k experts sit on one remote node crosses the
slow inter-node link k times, and its k outputs cross back k times. Here an ep group of N nodes x
L ranks (node-major: ep rank = node x L + local) is split into two stages (PaddleFleetX's and
DeepEP's topology-aware dispatch):

    1. inter-node   each token goes once to each node holding one of its experts, to the peer with
                    this rank's local index there (an all-to-all over the N ranks of that index),
                    with its router weights and, per assignment, which of the node's experts it wants
    2. intra-node   the peer sends the (token, expert) rows to the ranks owning the experts (the flat
                    exchange over the L ranks of its node), gets the outputs back, weights them and
                    sums them per token: one partial sum per (token, node)
    3. back         the partial sums cross back once per (token, node); the source adds them up

Rows crossing nodes per token: one per destination node each way, instead of one per expert.
Exactness: each token's partial sum adds its experts' weighted outputs in expert order, and the
source adds the partial sums in node order (= expert order, experts are laid out node by node), so
with top-2 the forward is bit-identical to the flat dispatch's `0 + w1 y1 + w2 y2`; the backward
sums a token's gradient copies in another order (rounding only). The router weights travel with
their tokens (autograd all-to-all), so their gradient is computed where the expert outputs are.

Bytes counted (traffic["internode"], fwd + bwd): the rows and weights sent to other nodes and
their gradients coming back, plus the int32 expert index per assignment (forward only). The
per-layer split sizes (N x 2 integers) are not counted, as the flat dispatch's are not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.nn import Module

from suite.config.errors import ConfigError
from suite.parallel.env import local_world_size, node_of
from suite.parallel.expert_parallel import ExpertParallelExperts, exchange_and_run, expert_rank_grid
from suite.parallel.expert_tensor_parallel import copy_to_tp, reduce_from_tp

EP_DISPATCH = ("flat", "hierarchical", "auto")


def node_layout(ranks: list[int], per_node: int) -> tuple[int, int] | None:
    """(nodes, ranks per node) of an ep group whose ranks fill its nodes node-major in equal blocks
    (what the hierarchical dispatch needs); None for any other layout."""
    nodes = [node_of(r, per_node) for r in ranks]
    count = len(set(nodes))
    if len(ranks) % count:
        return None
    local = len(ranks) // count
    blocks = [nodes[i : i + local] for i in range(0, len(ranks), local)]
    return (count, local) if all(len(set(b)) == 1 for b in blocks) else None


def resolve_dispatch(mode: str, layouts: list[tuple[int, int] | None]) -> str:
    """'flat' or 'hierarchical' for `parallel.ep_dispatch=mode` and the node layouts of the ep groups.
    Hierarchical needs every group laid out alike in equal node-major blocks; auto picks it where
    they also span more than one node."""
    fits = len(set(layouts)) == 1 and layouts[0] is not None
    if mode == "flat":
        return "flat"
    if mode == "auto":
        return "hierarchical" if fits and layouts[0][0] > 1 else "flat"
    if not fits:
        raise ConfigError(
            "parallel.ep_dispatch=hierarchical needs every ep group to fill its nodes in equal blocks of "
            "consecutive ranks (launch.nproc_per_node a multiple of the ep group's ranks per node); "
            "use parallel.ep_dispatch=flat or auto"
        )
    return "hierarchical"


def check_ep_dispatch(dims, cfg) -> str:
    """One-line ConfigError for a bad `parallel.ep_dispatch` (before launch); returns what will run
    where launch.nproc_per_node is a plain count (the ranks per node), else the mode as written."""
    mode = cfg.parallel.ep_dispatch
    if mode not in EP_DISPATCH:
        raise ConfigError(
            f"parallel.ep_dispatch={mode!r} is not one of {', '.join(EP_DISPATCH)}; use parallel.ep_dispatch=auto"
        )
    per_node = str(cfg.launch.nproc_per_node)
    if dims.ep > 1 and cfg.parallel.offload:  # offloaded experts: always the flat dispatch
        return "flat"
    if dims.ep == 1 or not per_node.isdigit():
        return mode
    return resolve_dispatch(mode, group_layouts(dims, int(per_node)))


def group_layouts(dims, per_node: int) -> list[tuple[int, int] | None]:
    """The node layout of every ep group of the job."""
    grid = expert_rank_grid(dims).permute(0, 1, 3, 2).reshape(-1, dims.ep)
    return [node_layout(row.tolist(), per_node) for row in grid]


class HierarchicalExperts(ExpertParallelExperts):
    """ExpertParallelExperts whose `combine` runs the two-stage exchange of the module docstring."""

    node_group: dist.ProcessGroup  # the N ranks of this local index, one per node
    local_group: dist.ProcessGroup  # the L ranks of this node
    num_nodes: int
    node_index: int  # this rank's node among the group's nodes
    local_size: int

    def combine(
        self, flat: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        flat = copy_to_tp(flat, self.tp_group)
        num_tokens, hidden = flat.shape
        per_node = counts.numel() // self.num_nodes  # experts per node
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=flat.device), counts)
        node = expert // per_node
        # 1. one row per (destination node, token): sorted by node, then token
        pair, inverse = torch.unique(node * num_tokens + tokens, return_inverse=True)
        pair_node, pair_token = pair // num_tokens, pair % num_tokens
        rows_to = torch.bincount(pair_node, minlength=self.num_nodes)
        assigned_to = torch.bincount(node, minlength=self.num_nodes)
        order = torch.argsort(inverse, stable=True)  # assignments by pair, in expert order within one
        first_pair = (rows_to.cumsum(0) - rows_to)[node[order]]
        what = ((inverse[order] - first_pair) * per_node + expert[order] - node[order] * per_node).to(
            torch.int32
        )
        sizes = torch.stack([rows_to, assigned_to], 1)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=self.node_group)
        send_rows, send_assigned = rows_to.tolist(), assigned_to.tolist()
        recv_rows, recv_assigned = got[:, 0].tolist(), got[:, 1].tolist()
        group = self.node_group
        x = all_to_all_single(
            flat.new_empty(sum(recv_rows), hidden), flat[pair_token], recv_rows, send_rows, group=group
        )
        w = all_to_all_single(
            weights.new_empty(sum(recv_assigned)), weights[order], recv_assigned, send_assigned, group=group
        )
        wants = torch.empty(sum(recv_assigned), dtype=torch.int32, device=flat.device)
        dist.all_to_all_single(wants, what, recv_assigned, send_assigned, group=group)
        # 2. inside the node: (row, expert) assignments through the flat exchange over the L ranks
        wants = wants.long()
        row = wants // per_node + torch.repeat_interleave(got[:, 0].cumsum(0) - got[:, 0], got[:, 1])
        node_expert = wants % per_node
        by_expert = torch.argsort(node_expert, stable=True)
        node_counts = torch.bincount(node_expert, minlength=per_node)
        y, intra_sent, intra_got = exchange_and_run(
            self, x[row[by_expert]], node_counts, self.local_group, self.local_size
        )
        y = reduce_from_tp(y, self.tp_group)[torch.argsort(by_expert)]
        y = y * w[:, None].to(y.dtype)
        partial = flat.new_zeros(x.shape[0], hidden).index_add_(0, row, y.to(flat.dtype))
        # 3. one partial sum per (token, node) back across nodes, added up in node order
        back = all_to_all_single(
            flat.new_empty(pair.numel(), hidden), partial, send_rows, recv_rows, group=group
        )
        if self.training:
            self._count(
                hidden * flat.element_size(),
                w.element_size(),
                send_rows,
                recv_rows,
                send_assigned,
                recv_assigned,
                intra_sent,
                intra_got,
            )
        return torch.zeros_like(flat).index_add_(0, pair_token, back)

    def _count(
        self, row: int, weight: int, send_rows, recv_rows, send_assigned, recv_assigned, intra_sent, intra_got
    ) -> None:
        """Bytes of this training step's exchanges (see the module docstring), fwd + bwd."""
        remote = [n for n in range(self.num_nodes) if n != self.node_index]
        internode = sum(
            2 * row * (send_rows[n] + recv_rows[n])
            + weight * (send_assigned[n] + recv_assigned[n])
            + 4 * send_assigned[n]
            for n in remote
        )
        me = self.ep_rank % self.local_size
        intra = sum(2 * row * (intra_sent[i] + intra_got[i]) for i in range(self.local_size) if i != me)
        self.traffic["internode"] += internode
        self.traffic["bytes"] += internode + intra


def apply_hierarchical_dispatch(model: Module, dims, device_type: str, mode: str) -> str:
    """Turn the model's ExpertParallelExperts into HierarchicalExperts where `mode` (parallel.ep_dispatch)
    resolves to hierarchical for this job's ep groups; returns what runs. Collective (builds the
    inter- and intra-node groups)."""
    layouts = group_layouts(dims, local_world_size() or dims.world_size)
    if resolve_dispatch(mode, layouts) == "flat":
        return "flat"
    nodes, local = layouts[0]  # the same for every group: the world is node-major in equal blocks
    grid = expert_rank_grid(dims).view(dims.pp, -1, nodes, local, dims.tp)
    names = ("pp", "edp", "ep_node", "ep_local", "tp")
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=names)
    node_group, local_group = mesh.get_group("ep_node"), mesh.get_group("ep_local")
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            module.__class__ = HierarchicalExperts
            module.ep_dispatch = "hierarchical"
            module.node_group, module.local_group = node_group, local_group
            module.num_nodes, module.local_size = nodes, local
            module.node_index = mesh.get_local_rank("ep_node")
    return "hierarchical"
