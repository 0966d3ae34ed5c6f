"""One layout's training step: memory per device and its parts, step time and its parts, tokens/s,
achieved TFLOP/s per device and MFU.

Step time of the slowest pipeline rank (Narayanan et al. 2021, section 2.2 and 3):

    t_mb      one micro-batch's forward + backward (+ recompute) on the rank: its FLOPs over
              peak x compute_efficiency, plus the exposed tp, cp and ep communication of its layers
    compute   m t_mb                          (m micro-batches per step and data rank)
    bubble    (p - 1)/v t_mb                  (a bubble fraction (p - 1)/(v m); GPipe and 1F1B v = 1;
                                               zero-bubble: a third of 1F1B's, Qi et al. 2023 ZB-H1;
                                               where ranks time-share the cores, `pipeline`)
    pp p2p    2 (m v + p - 1) t_send          (activations forward, gradients back, on the critical path)
    data      data-parallel / sharding collectives not hidden under compute
    optimizer AdamW's bytes over memory bandwidth (offload: on the host, over the node's CPU memory
              bandwidth shared by its ranks); optim=muon adds Newton-Schulz and its gather/scatter
              (suite.plan.muon_cost)
    offload   the host link's transfers of offload not hidden under compute: each micro-batch's
              parameter shards up before FSDP gathers them (forward, and backward at stage 3) and
              reduced gradient shards down (FSDP2's CPUOffloadPolicy), in the gather's and the
              reduce-scatter's streams
    host      m x the micro-batch's per-layer runtime overhead (cluster.layer_overhead_us and what tp,
              dp and sharding add per layer; in t_mb, so the bubble carries it) + their per-step terms:
              0 on GPU presets, measured on the cpu preset, where a small model's steps are mostly this

Overlap assumptions (cluster.comm_overlap=true; a CPU cluster overlaps nothing): tp collectives (all-reduce, or all-gather + reduce-scatter with sp) and ep
all-to-alls (hierarchical across nodes: suite.plan.comm.expert_exchange) sit on the critical path (no overlap); cp's ring exchange hides under the attention it
feeds; pipeline sends do not overlap; FSDP all-gathers and reduce-scatters hide under each
micro-batch's compute and gradient all-reduces under the last micro-batch's backward (whatever
exceeds the window is exposed); ZeRO-1's parameter all-gather after the step is exposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from suite.config.cluster import ClusterConfig
from suite.models.moe import moe_layer_ids
from suite.models.transformer import head_size, kv_heads
from suite.plan import comm
from suite.plan.activations import rank_activations
from suite.plan.flops import head_forward_flops, layer_table, recompute_flops, step_flops
from suite.plan.layout import Job, Layout, with_
from suite.plan.memory import ADAM_STATE_BYTES, MASTER_BYTES, foreach_adamw, state_bytes
from suite.plan.muon_cost import muon_time
from suite.plan.params import pp_rank_params, rank_layers

GIB = 2**30
# torch._multi_tensor_adamw's passes over fp32 state, bytes read + written per parameter: p *= 1 - lr wd (8),
# m.lerp_(g) (12), v *= b2 (8), v.addcmul_(g, g) (12), t = sqrt(v) (8), t /= c2 (8), t += eps (8),
# p.addcdiv_(m, t) (16); fused: 28
FOREACH_ADAMW_BYTES = 80


@dataclass(frozen=True)
class Memory:
    """Peak bytes on the worst device, by part. The parts do not all exist at once: the peak is the
    larger of backward's (weights, optimizer state, compute copies, activations, and the gradients
    of earlier micro-batches when there are several) and the optimizer step's (weights, optimizer
    state, gradients, foreach AdamW's working copy; compute copies and activations are freed)."""

    weights: float
    compute_copies: float
    gradients: float
    optimizer: float
    activations: float
    host: float  # offloaded (not on the device)
    capacity: float  # what the job may use: memory_gib - reserved_gib
    optimizer_work: float = 0.0
    accumulating: bool = True  # more than one micro-batch per step: gradients held through backward
    # the worst rank's share of its node's host memory (cluster.host_memory_gib / devices_per_node:
    # every rank of the node offloads as much); None: host memory not bounded
    host_capacity: float | None = None

    @property
    def backward(self) -> float:
        held = self.gradients if self.accumulating else 0.0
        return self.weights + self.optimizer + self.compute_copies + self.activations + held

    @property
    def optimizer_step(self) -> float:
        return self.weights + self.optimizer + self.gradients + self.optimizer_work

    @property
    def total(self) -> float:
        return max(self.backward, self.optimizer_step)

    @property
    def fits_device(self) -> bool:
        return self.total <= self.capacity

    @property
    def fits_host(self) -> bool:
        """Whether the offloaded state of the node's ranks fits in its host memory."""
        return self.host_capacity is None or self.host <= self.host_capacity

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


@dataclass(frozen=True)
class Time:
    """Seconds of one optimizer step on the critical path, by part."""

    compute: float  # m x the micro-batch's FLOPs at the sustained rate (time-shared: see `pipeline`)
    tp: float
    cp: float
    ep: float
    bubble: float
    pp: float
    data: float
    optimizer: float
    host: float = 0.0  # m x the micro-batch's host overhead, + the step's (cluster.layer_overhead_us)
    offload: float = 0.0  # exposed host-link transfers of offload (module docstring)

    @property
    def total(self) -> float:
        parts = (self.compute, self.tp, self.cp, self.ep, self.bubble, self.pp, self.data, self.optimizer)
        return sum(parts) + self.host + self.offload


@dataclass(frozen=True)
class Cost:
    layout: Layout
    memory: Memory
    time: Time
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (with recompute) per second per device / 1e12
    mfu: float  # model FLOPs (no recompute) over the peak
    micro_batches: int
    params_per_device: int  # the worst rank's parameters held at rest

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.name,
            "parallel": asdict(self.layout),
            "fits": self.memory.fits,
            "fits_host": self.memory.fits_host,
            "memory_gib": {
                k: v / GIB for k, v in asdict(self.memory).items() if k != "accumulating" and v is not None
            }
            | {"total": self.memory.total / GIB},
            "time_s": asdict(self.time) | {"total": self.time.total},
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "micro_batches": self.micro_batches,
            "params_per_device": self.params_per_device,
        }


def _rank_compute(job: Job, layout: Layout, layers: list[int], last: bool) -> tuple[float, float, float]:
    """(FLOPs, forward FLOPs, attention-core FLOPs) of one micro-batch on a rank holding `layers`:
    3 x forward + recompute (run in backward), split over tp and cp."""
    m, seq, b = job.model, job.seq_len, layout.micro_batch
    table = layer_table(m, seq)
    flops = forward = core = 0.0
    for layer in layers:
        f = table[layer]
        flops += 3 * f.total + recompute_flops(f, layout.recompute)
        forward += f.total
        core += 3 * f.core
    if last:
        flops += 3 * head_forward_flops(m, seq)
        forward += head_forward_flops(m, seq)
    split = layout.tp * layout.cp
    return flops * b / split, forward * b / split, core * b / split


def _rate(job: Job) -> float:
    c = job.cluster
    return c.peak_flops[job.precision] * c.compute_efficiency


def _wrappers(layout: Layout) -> list[str]:
    """The wrappers on a layout's layers, as the cluster's overhead keys name them."""
    names = ["tp"] if layout.tp > 1 else []
    if layout.data_ranks > 1:
        names.append("shard" if layout.sharding > 1 and layout.stage >= 2 else "dp")
    return names


def _host_per_micro_batch(job: Job, layout: Layout, layers: list[int]) -> float:
    """Host seconds of one micro-batch on a rank holding `layers`: the runtime's per-layer overhead
    plus what each wrapper on the layer adds (ClusterConfig.layer_overhead_us and its siblings)."""
    c = job.cluster
    per_layer = c.layer_overhead_us + sum(getattr(c, f"{w}_layer_overhead_us") for w in _wrappers(layout))
    return len(layers) * per_layer * 1e-6


def _host_per_step(job: Job, layout: Layout) -> float:
    """Host seconds once per step: the runtime's and each wrapper's (ClusterConfig.step_overhead_ms)."""
    c = job.cluster
    return (c.step_overhead_ms + sum(getattr(c, f"{w}_step_overhead_ms") for w in _wrappers(layout))) * 1e-3


def _micro_batch_comm(
    job: Job, layout: Layout, layers: list[int], core_time: float
) -> tuple[float, float, float]:
    """Exposed (tp, cp, ep) seconds of one micro-batch on a rank holding `layers`."""
    m, c, e = job.model, job.cluster, job.compute_bytes
    tokens = job.seq_len / layout.cp * layout.micro_batch
    act = e * tokens * m.hidden_size
    moe = set(moe_layer_ids(m))
    tp = cp = ep = 0.0
    moe_layers = sum(1 for layer in layers if layer in moe)
    if layout.tp > 1:
        # per layer 2 forward + 2 backward all-reduces (under sp an all-gather + a reduce-scatter each:
        # the same time on a ring, not where the backend runs them slower), attention's and the MLP's,
        # plus the forward's again when recomputed (full: both, full_attn: attention's); an MoE
        # layer's MLP pair reduces its routed rows, top_k copies of the tokens
        # (suite.parallel.expert_tensor_parallel)
        attn = 2 + (1 if layout.recompute in ("full", "full_attn") else 0)
        mlp = 2 + (1 if layout.recompute == "full" else 0)
        link = comm.group_link(c, layout, "tp")

        def reduce(size: float) -> float:
            if layout.sp:
                return comm.all_gather(link, size) + comm.reduce_scatter(link, size)
            return comm.all_reduce(link, size)

        tp = len(layers) * attn * reduce(act)
        tp += (len(layers) - moe_layers) * mlp * reduce(act)
        tp += moe_layers * mlp * reduce(act * m.top_k)
        if layout.pp == 1:  # vocabulary-parallel embedding (forward) and head input (backward)
            tp += 2 * reduce(act)
    if layout.cp > 1:
        # ring attention: cp - 1 exchanges of the local K and V forward, K, V, dK, dV backward
        kv = e * tokens * 2 * kv_heads(m) * head_size(m) / layout.tp
        link = comm.group_link(c, layout, "cp")
        per_layer = 3 * (layout.cp - 1) * comm.send_recv(link, kv)
        cp = max(0.0, per_layer * len(layers) - (core_time if c.comm_overlap else 0.0))
    if layout.ep > 1 and moe_layers:
        per_layer = 4 + (2 if layout.recompute == "full" else 0)  # dispatch + combine, each way
        ep = per_layer * moe_layers * comm.expert_exchange(c, layout, act, m.num_experts, m.top_k)
    return tp, cp, ep


def offloads(job: Job, layout: Layout) -> bool:
    """Whether the layout's state crosses the host link (a CPU's offload stays where it is)."""
    return layout.offload and job.cluster.device_type != "cpu"


def _data_comm(
    job: Job, layout: Layout, full: float, sharded: float, forward: float, backward: float, m: int
) -> tuple[float, float]:
    """Exposed seconds per step of data-parallel and sharding collectives, and of offload's host-link
    transfers (module docstring): FSDP's forward all-gather (after its shard's copy up) hides under the
    micro-batch's forward, the backward all-gather and the reduce-scatter (and the copy down) under its
    backward (with the recompute); a gradient all-reduce under the last micro-batch's backward. The
    host link's share is what exposure the transfers add."""
    c = job.cluster
    if layout.data_ranks == 1:
        return 0.0, 0.0
    data_link = comm.group_link(c, _merged_data(layout), "dp")
    if layout.sharding == 1 or layout.stage == 1:  # replicate or ZeRO-1: all-reduce at the last micro-batch
        exposed = max(0.0, comm.all_reduce(data_link, full * job.reduce_bytes) - backward)
        if layout.sharding > 1:  # ZeRO-1: updated slices all-gathered after the step
            exposed += comm.all_gather(data_link, full * job.param_bytes)
        return exposed, 0.0
    shard_link = comm.group_link(c, layout, "sharding")
    gather = comm.all_gather(shard_link, full * job.compute_bytes)
    reduce = comm.reduce_scatter(shard_link, full * job.reduce_bytes)
    up = down = 0.0
    if offloads(job, layout):  # the shard (param dtype) up before each gather, its reduced gradient down
        link = c.host_bandwidth_gbs * 1e9
        up, down = sharded * job.param_bytes / link, sharded * job.reduce_bytes / link
    gathers = 2 if layout.stage == 3 else 1

    def exposed_per_micro_batch(up: float, down: float) -> float:
        in_backward = reduce + down + (gathers - 1) * (gather + up)
        return max(0.0, gather + up - forward) + max(0.0, in_backward - backward)

    exposed = m * exposed_per_micro_batch(0.0, 0.0)
    host_link = m * exposed_per_micro_batch(up, down) - exposed
    if layout.dp > 1:  # HSDP: the sharded gradients all-reduced across replicas once
        exposed += max(
            0.0, comm.all_reduce(comm.group_link(c, layout, "dp"), sharded * job.reduce_bytes) - backward
        )
    return exposed, host_link


def _merged_data(layout: Layout) -> Layout:
    """A layout whose dp axis is the whole data group (dp x sharding, adjacent in the mesh)."""
    return with_(layout, dp=layout.data_ranks, sharding=1)


def _optimizer_time(job: Job, layout: Layout, full: float, sharded: float) -> float:
    """AdamW reads and writes its moments, the parameters and master copies, reads the gradients:
    (2 x 8 + 2 p + p (+ 2 x 4 master)) bytes per updated parameter over memory bandwidth, in one
    pass (fused). torch's foreach AdamW makes eight passes instead (decay, lerp, mul, addcmul, sqrt,
    div, add, addcdiv: 80 bytes per fp32 parameter, FOREACH_ADAMW_BYTES). Offloaded, the step runs
    on the host (FSDP2's CPUOffloadPolicy), over the node's CPU memory bandwidth that its ranks share
    at once; the transfers to and from the host are `Time.offload`'s."""
    c = job.cluster
    p = job.param_bytes
    updated = sharded if layout.sharding > 1 else full
    per = 2 * ADAM_STATE_BYTES + 3 * p + (2 * MASTER_BYTES if p < 4 else 0)
    if foreach_adamw(job, layout):
        per = FOREACH_ADAMW_BYTES + (2 * MASTER_BYTES if p < 4 else 0)
    if offloads(job, layout):
        return updated * per / (c.host_memory_bandwidth_gbs * 1e9 / c.devices_per_node)
    return updated * per / (c.memory_bandwidth_gbs * 1e9)


def pipeline(
    layout: Layout, stages: list[tuple[float, ...]], m: int, time_share: float = 1.0
) -> tuple[tuple[float, ...], float]:
    """The pipeline's seconds per step: (m x each part of a micro-batch on the rank that sets the
    pace, the bubble). `stages` holds each stage's micro-batch parts (compute, tp, cp, ep, host).

    With a core per rank (time_share 1) the slowest stage sets the pace: m of its micro-batches plus
    its fill and drain, (p - 1)/v of them (Narayanan et al. 2021, section 2.2.1; zero-bubble a third,
    Qi et al. 2023 ZB-H1). Where processes time-share the cores (time_share = cores / threads < 1,
    the parts timed at that share), a rank that waits lends its core to the others, as the OS
    scheduler does. The step is then the larger of two bounds: the work, every stage's m
    micro-batches over the shared cores (m x the stages' mean); and the critical path, the formula
    above with the slowest stage run as fast as it can alone, at one core per rank and its ranks'
    1/p of the threads sharing all the cores (max(time_share, 1/p) of its shared time). At
    time_share 1 the second is the first formula."""
    slowest = max(stages, key=sum)
    alone = max(time_share, 1 / layout.pp)
    bubble = (layout.pp - 1) / layout.vpp * sum(slowest)
    if layout.schedule == "zero_bubble":
        bubble /= 3
    mean = tuple(sum(parts) / len(stages) for parts in zip(*stages))
    if (m * sum(slowest) + bubble) * alone >= m * sum(mean):
        return tuple(m * alone * x for x in slowest), bubble * alone
    return tuple(m * x for x in mean), 0.0


# the cluster's host seconds beyond FLOPs and links (ClusterConfig; bench/plan_cpu.py --calibrate)
HOST_OVERHEADS = (
    "layer_overhead_us",
    "tp_layer_overhead_us",
    "dp_layer_overhead_us",
    "shard_layer_overhead_us",
    "step_overhead_ms",
    "tp_step_overhead_ms",
    "dp_step_overhead_ms",
    "shard_step_overhead_ms",
)
# what a process that gets a share of a core does that many times slower: rates, and delays
SHARED_RATES = ("memory_bandwidth_gbs", "intra_node_bandwidth_gbs", "inter_node_bandwidth_gbs")
SHARED_DELAYS = ("intra_node_latency_us", "inter_node_latency_us", *HOST_OVERHEADS)


def at_time_share(cluster: ClusterConfig) -> ClusterConfig:
    """The cluster as one process sees it when it gets `time_share` of a core: compute, memory and
    links (gloo runs on the cores) that many times slower, latencies and host overheads that many
    times longer (suite.plan.fit.time_shared sets the share for a launch with more threads than
    cores). The result's own share is 1: its rates are already the shared ones, so scaling twice is
    scaling once."""
    f = cluster.time_share
    if f == 1.0:
        return cluster
    return replace(
        cluster,
        time_share=1.0,
        peak_flops={k: v * f for k, v in cluster.peak_flops.items()},
        **{key: getattr(cluster, key) * f for key in SHARED_RATES},
        **{key: getattr(cluster, key) / f for key in SHARED_DELAYS},
    )


def evaluate(job: Job, layout: Layout) -> Cost:
    """The cost of one step of `job` under `layout` (assumed valid: suite.plan.layout.check_layout)."""
    share = job.cluster.time_share
    job = replace(job, cluster=at_time_share(job.cluster))
    c, model = job.cluster, job.model
    m = layout.micro_batches(job.global_batch)
    shards = layout.sharding if layout.sharding > 1 else 1
    table = pp_rank_params(model, layout.pp, layout.vpp, layout.tp, layout.ep, shards)
    layers_of = rank_layers(model, layout.pp, layout.vpp)
    moe = set(moe_layer_ids(model))
    rate = _rate(job)
    capacity = (c.memory_gib - c.reserved_gib) * GIB
    host_capacity = None if c.host_memory_gib is None else c.host_memory_gib * GIB / c.devices_per_node
    worst_t, worst_mem, stages = 0.0, None, []
    t_forward = worst_host = 0.0
    for rank, (params, layers) in enumerate(zip(table, layers_of)):
        flops, forward, core = _rank_compute(job, layout, layers, last=rank == layout.pp - 1)
        compute = flops / rate
        tp, cp, ep = _micro_batch_comm(job, layout, layers, core / rate)
        host = _host_per_micro_batch(job, layout, layers)
        t = compute + tp + cp + ep + host
        stages.append((compute, tp, cp, ep, host))
        if t > worst_t:
            worst_t, t_forward, worst_host = t, forward / rate, host
        state = state_bytes(job, layout, params)
        acts = rank_activations(job, layout, len(layers), sum(1 for x in layers if x in moe), rank)
        mem = Memory(
            state.weights,
            state.compute_copies,
            state.gradients,
            state.optimizer,
            acts.total,
            state.host,
            capacity,
            state.optimizer_work,
            m > 1,
            host_capacity,
        )
        if worst_mem is None or mem.total > worst_mem[0].total:
            worst_mem = (mem, state, params)
    assert worst_mem is not None
    memory, _, params = worst_mem
    # cores are lent between stages on one machine, not across nodes
    pooled = share if not comm.group_link(c, layout, "pp").inter_node else 1.0
    (compute, tp, cp, ep, host), bubble = pipeline(layout, stages, m, pooled)
    p, v = layout.pp, layout.vpp
    pp_time = 0.0
    if p > 1:
        sp_div = layout.tp if layout.sp else 1
        act = job.compute_bytes * job.seq_len / layout.cp * layout.micro_batch * model.hidden_size / sp_div
        pp_time = 2 * (m * v + p - 1) * comm.send_recv(comm.group_link(c, layout, "pp"), act)
    full = max(r.unsharded for r in table)
    sharded = max(r.sharded for r in table)
    # collectives hide under the device's work, not under the host's (overlap windows exclude `host`)
    windows = (t_forward, worst_t - worst_host - t_forward) if c.comm_overlap else (0.0, 0.0)
    data, offload = _data_comm(job, layout, full, sharded, *windows, m)
    optimizer = _optimizer_time(job, layout, full, sharded) + muon_time(job, layout, params.pp_rank)
    host_time = host + _host_per_step(job, layout)
    time = Time(compute, tp, cp, ep, bubble, pp_time, data, optimizer, host_time, offload)
    model_flops, hardware_flops = step_flops(model, job.seq_len, job.global_batch, layout.recompute)
    step = time.total
    return Cost(
        layout=layout,
        memory=memory,
        time=time,
        tokens_per_s=job.global_batch * job.seq_len / step,
        tflops_per_device=hardware_flops / step / job.world / 1e12,
        mfu=model_flops / step / job.world / c.peak_flops[job.precision],
        micro_batches=m,
        params_per_device=params.sharded if layout.sharding > 1 and layout.stage >= 2 else params.unsharded,
    )
