"""Collectives: which link a process group crosses, and how long a collective of S bytes takes on it.

Placement: suite.parallel.mesh lays ranks out in the order pp, dp, sharding, cp, tp (outermost
first, tp innermost), node by node. A group of axis X has a stride equal to the product of the
sizes of the axes inside X; it stays inside a node when stride x size <= devices_per_node.

Times (Thakur, Rabenseifner & Gropp 2005; NCCL's ring algorithm), n ranks, latency L, bandwidth B:

    all-reduce        2 (n - 1)/n * S / B + 2 (n - 1) L
    reduce-scatter    (n - 1)/n * S / B + (n - 1) L          (S: the full, unsharded buffer)
    all-gather        (n - 1)/n * S / B + (n - 1) L
    all-to-all        (n - 1)/n * S / B + (n - 1) L
    send/recv         S / B + L

Inside a node B is the per-device NVLink bandwidth; a group that spans nodes is taken as a flat ring
in which every rank's traffic crosses its own share of the node's network, B = inter_node_bandwidth
/ devices_per_node. NCCL's multi-channel rings can do better for groups with several ranks per node;
the ZeRO-3 runs of Narayanan et al. 2021 (Table 2) match the flat model (docs/planner.md). Each
bandwidth is scaled by the cluster's stated efficiency (cluster.*_efficiency), and each collective's
by its own factor where the backend runs it slower than its ring (cluster.collective_efficiency: gloo's
reduce-scatter is a whole all-reduce; bench/gloo_collectives.py measures them).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from suite.config.cluster import ClusterConfig
from suite.plan.layout import Layout

AXES = ("pp", "dp", "sharding", "cp", "tp")  # suite.parallel.dims.MESH_ORDER, outermost first


@dataclass(frozen=True)
class Link:
    """The link a group's collectives are limited by."""

    ranks: int
    inter_node: bool
    bandwidth: float  # bytes/s, efficiency applied
    latency: float  # seconds
    per_collective: tuple[tuple[str, float], ...] = ()  # cluster.collective_efficiency's items

    def bandwidth_of(self, collective: str) -> float:
        """The bandwidth `collective` reaches on this link (its own factor applied)."""
        return self.bandwidth * dict(self.per_collective).get(collective, 1.0)

    @property
    def name(self) -> str:
        return "network" if self.inter_node else "nvlink" if self.ranks > 1 else "none"


def group_link(cluster: ClusterConfig, layout: Layout, axis: str) -> Link:
    """The link of `axis`'s process group (see the module docstring); ep groups are data ranks."""
    if axis == "ep":
        inner = layout.cp * layout.tp
        size, stride = layout.ep, inner
    else:
        index = AXES.index(axis)
        stride = 1
        for inner_axis in AXES[index + 1 :]:
            stride *= getattr(layout, inner_axis)
        size = getattr(layout, axis)
    inter = stride * size > cluster.devices_per_node
    if inter:
        bandwidth = cluster.inter_node_bandwidth_gbs * 1e9 / cluster.devices_per_node
        bandwidth *= cluster.inter_node_efficiency
        latency = cluster.inter_node_latency_us * 1e-6
    else:
        bandwidth = cluster.intra_node_bandwidth_gbs * 1e9 * cluster.intra_node_efficiency
        latency = cluster.intra_node_latency_us * 1e-6
    return Link(size, inter, bandwidth, latency, tuple(sorted(cluster.collective_efficiency.items())))


def all_reduce(link: Link, size: float) -> float:
    """Ring all-reduce of `size` bytes: 2 (n-1)/n S/B + 2 (n-1) L."""
    n = link.ranks
    bandwidth = link.bandwidth_of("all_reduce")
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * link.latency


def _ring_pass(link: Link, size: float, collective: str) -> float:
    """One pass of a ring over a `size`-byte buffer: (n-1)/n S/B + (n-1) L."""
    n = link.ranks
    return 0.0 if n <= 1 else (n - 1) / n * size / link.bandwidth_of(collective) + (n - 1) * link.latency


def reduce_scatter(link: Link, size: float) -> float:
    """Ring reduce-scatter of a `size`-byte buffer: (n-1)/n S/B + (n-1) L."""
    return _ring_pass(link, size, "reduce_scatter")


def all_gather(link: Link, size: float) -> float:
    """Ring all-gather into a `size`-byte buffer: (n-1)/n S/B + (n-1) L."""
    return _ring_pass(link, size, "all_gather")


def all_to_all(link: Link, size: float) -> float:
    """All-to-all of `size` bytes per rank: (n-1)/n of it leaves the rank: (n-1)/n S/B + (n-1) L."""
    return _ring_pass(link, size, "all_to_all")


def send_recv(link: Link, size: float) -> float:
    """Point-to-point: S/B + L."""
    return size / link.bandwidth_of("send_recv") + link.latency


def expert_exchange(
    cluster: ClusterConfig, layout: Layout, size: float, num_experts: int, top_k: int
) -> float:
    """One all-to-all of the expert dispatch (or combine) for tokens of `size` bytes per rank.

    Inside a node, flat: top_k rows per token. An ep group spanning N nodes of L ranks each is
    dispatched hierarchically (parallel.ep_dispatch=auto, suite.parallel.hierarchical_dispatch): each
    token crosses once to each node holding one of its experts, over the N ranks of one local index,
    then top_k rows inside the node over the L ranks. Expected nodes a token reaches under uniform
    top-k routing: N (1 - C(E - E/N, k) / C(E, k)) (0.79 of the flat rows at E = 4, k = 2, N = 2)."""
    link = group_link(cluster, layout, "ep")
    extent = layout.ep * layout.cp * layout.tp  # ranks an ep group spans (ep strides over cp x tp)
    nodes = extent // cluster.devices_per_node if link.inter_node else 1
    if nodes <= 1 or layout.ep % nodes or num_experts % nodes or extent % cluster.devices_per_node:
        return all_to_all(link, size * top_k)
    reached = nodes * (1 - comb(num_experts - num_experts // nodes, top_k) / comb(num_experts, top_k))
    across = Link(nodes, True, link.bandwidth, link.latency, link.per_collective)
    inside = Link(
        layout.ep // nodes,
        False,
        cluster.intra_node_bandwidth_gbs * 1e9 * cluster.intra_node_efficiency,
        cluster.intra_node_latency_us * 1e-6,
        link.per_collective,
    )
    return all_to_all(across, size * reached) + all_to_all(inside, size * top_k)
