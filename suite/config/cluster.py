"""The `cluster` config group: the machines `suite plan` costs a job on (one of the structured
configs of suite.config.schema, kept in its own module for length; defaults live here and only here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# the collectives the planner costs (suite.plan.comm), each with its own cluster.collective_efficiency
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")


@dataclass
class ClusterConfig:
    """The machines a job runs on, for `suite plan` (suite/plan/): what one device computes and holds,
    and the links between devices. Presets in recipes/cluster/ (a100-40g, a100-80g, h100-80g, h200, cpu).

    Bandwidths are per direction in GB/s (1e9 bytes/s); `*_efficiency` is the fraction of a link's
    nominal bandwidth that large collectives achieve (NCCL bus bandwidth over the data sheet), and
    `compute_efficiency` the fraction of the dense peak that a transformer's large matmuls sustain,
    `collective_efficiency` a further factor per collective where the backend runs one slower than its
    ring (gloo): the cost model's calibration constants, with the CPU's host overheads (docs/planner.md)."""

    name: str = "generic"
    device_type: str = "cuda"  # cuda | cpu: settles the recipe's `auto` precision and attention for the plan
    nodes: int = 1
    devices_per_node: int = 1
    memory_gib: float = 16.0  # per device (HBM; host RAM for a CPU process)
    reserved_gib: float = 0.0  # per device, not for the job: runtime context, allocator fragmentation
    # dense (no sparsity) FLOP/s per device by train.precision
    peak_flops: dict[str, float] = field(default_factory=lambda: {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11})
    compute_efficiency: float = 1.0  # sustained fraction of peak_flops on a transformer's matmuls
    memory_bandwidth_gbs: float = 20.0  # device memory (the optimizer step is bound by it)
    intra_node_bandwidth_gbs: float = 1.0  # per device, per direction (NVLink; loopback on CPU)
    intra_node_latency_us: float = 10.0
    intra_node_efficiency: float = 1.0
    inter_node_bandwidth_gbs: float = 1.0  # per node, per direction (all NICs together)
    inter_node_latency_us: float = 10.0
    inter_node_efficiency: float = 1.0
    # a further factor on a link's bandwidth for one collective (COLLECTIVES) where the backend runs it
    # slower than the ring formula (gloo: reduce-scatter as a whole all-reduce); 1.0 on GPUs (NCCL).
    # Measured: bench/gloo_collectives.py
    collective_efficiency: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 1.0))
    host_bandwidth_gbs: float = 16.0  # device <-> host per device (PCIe), what parallel.offload crosses
    # host (CPU) memory per node, shared by the node's processes: what parallel.offload's state must fit
    # in (suite.plan.cost.Memory.fits_host); None: not bounded (the planner says so in --explain)
    host_memory_gib: Optional[float] = None
    # the node's CPU memory bandwidth (all sockets), over which an offloaded optimizer step runs on the host
    host_memory_bandwidth_gbs: float = 100.0
    # whether collectives can run under compute (GPUs: separate engines and streams); false on a CPU,
    # whose cores do both (gloo), so every collective is on the critical path
    comm_overlap: bool = True
    # the share of a core each process gets (1.0: one each; 0.5: two processes per core): the cost model
    # runs every rate that much slower (suite.plan.cost.at_time_share) and lends an idle pipeline rank's
    # core to the others; a launch with more threads than cores caps it at cores / threads
    # (suite.plan.fit.time_shared)
    time_share: float = 1.0
    # Host seconds per layer per micro-batch (forward + backward) that are neither FLOPs nor link time:
    # eager dispatch and autograd on a CPU, where they order a small model's layouts; 0 on GPUs, whose
    # kernels queue ahead of the device. The tp, dp and sharding terms are what each wrapper adds to a
    # layer (DTensor dispatch; replicate's and FSDP's hooks, gathers and gradient copies); the *_step_*
    # terms are once per optimizer step (data, logging, the embedding and head, the optimizer over the
    # wrapper's tensors). Measured: bench/plan_cpu.py --calibrate
    layer_overhead_us: float = 0.0
    tp_layer_overhead_us: float = 0.0
    dp_layer_overhead_us: float = 0.0
    shard_layer_overhead_us: float = 0.0
    step_overhead_ms: float = 0.0
    tp_step_overhead_ms: float = 0.0
    dp_step_overhead_ms: float = 0.0
    shard_step_overhead_ms: float = 0.0
