"""Does the recipe fit where it is launched? `suite pretrain` asks the planner before anything is
allocated, so that a recipe written for a cluster stops in seconds on a laptop with one line that
says what it would need.

The job is the recipe's own layout on the world it launches (launch.nnodes x launch.nproc_per_node):
the cost model's memory for its worst rank (weights, compute copies, gradients, optimizer state and
activations: suite.plan.cost) against the memory one process has here: the GPU's, or for CPU
processes this machine's available RAM shared among this node's processes. Only a clear excess
(more than FIT_MARGIN times) stops the run: the activation model is an estimate, and a run that
fits must not be blocked (suite.parallel.hosting still refuses, more gently, a job whose model state
alone exceeds the memory). The smallest cluster then comes from the search over the cluster group
(suite.plan.search.smallest_cluster).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from suite.config.cluster import ClusterConfig
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.config.validate import nproc_range
from suite.parallel import hosting
from suite.parallel.dims import MULTI_STAGE, ParallelDims
from suite.plan.command import job_of
from suite.plan.cost import GIB, evaluate
from suite.plan.layout import Job, Layout
from suite.plan.params import count_params
from suite.plan.search import smallest_cluster

FIT_MARGIN = 1.25  # stop only when the estimate exceeds the memory by more than this factor
# what `suite plan` needs to see of the user's overrides to plan the same job
PLAN_KEYS = (
    "recipe", "model", "data.seq_len", "parallel.global_batch_size", "train.precision", "train.param_dtype",
    "train.loss_chunk_tokens", "cluster",
)  # fmt: skip


def run_device(cfg: SuiteConfig) -> str:
    """`cuda` or `cpu`: where this run's processes compute (train.device, `auto` as the trainer
    settles it)."""
    device = cfg.train.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_memory(cfg: SuiteConfig) -> tuple[float, str]:
    """Bytes one process of this node has, and in words: the GPU's memory, or this machine's
    available RAM shared by this node's launch.nproc_per_node processes."""
    nproc = nproc_range(cfg)[1]
    if run_device(cfg) == "cuda":
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"each {props.name} has {props.total_memory / GIB:.1f} GiB"
    ram = hosting.available_ram()  # looked up at call time: tests stand in for the machine
    procs = f"{nproc} CPU processes" if nproc > 1 else "one CPU process"
    return ram / nproc, f"this machine has {ram / GIB:.1f} GiB of memory available for {procs}"


def launched_cluster(cfg: SuiteConfig, here: bool = True) -> ClusterConfig:
    """The cluster group sized to this launch: launch.nnodes nodes of launch.nproc_per_node devices.
    CPU processes that run `here` get the less of the preset's memory and their share of the RAM
    available on this machine (a dry run allocates nothing: the preset's memory stands)."""
    nproc = nproc_range(cfg)[1]
    cluster = replace(cfg.cluster, nodes=cfg.launch.nnodes, devices_per_node=nproc)
    if here and cluster.device_type == "cpu":
        share = device_memory(cfg)[0] / GIB + cluster.reserved_gib
        cluster = replace(cluster, memory_gib=min(cluster.memory_gib, share))
        cluster = time_shared(cluster, nproc * (cfg.train.num_threads or 1), len(os.sched_getaffinity(0)))
    return cluster


def time_shared(cluster: ClusterConfig, threads: int, cores: int) -> ClusterConfig:
    """A CPU cluster whose processes run `threads` threads on `cores` cores in all: with more threads
    than cores they time-share them, each at cores / threads of its speed alone (gloo runs on the same
    cores; bench/plan_cpu.py: 4 processes on 2 cores). The share caps `cluster.time_share`, by which
    the cost model slows every rate (suite.plan.cost.at_time_share)."""
    if threads <= cores:
        return cluster
    return replace(cluster, time_share=min(cluster.time_share, cores / threads))


def recipe_layout(cfg: SuiteConfig, dims: ParallelDims) -> Layout:
    """The recipe's own layout (its resolved degrees) as the planner names it."""
    p = cfg.parallel
    multi = dims.pp > 1 and p.pp_schedule in MULTI_STAGE
    return Layout(
        dp=dims.dp,
        sharding=dims.sharding,
        stage=p.sharding_stage,
        offload=bool(p.offload),
        tp=dims.tp,
        sp=bool(p.sp) and dims.tp > 1,
        pp=dims.pp,
        schedule=p.pp_schedule if dims.pp > 1 else "1f1b",
        vpp=p.vpp if multi else 1,
        cp=dims.cp,
        ep=dims.ep,
        micro_batch=p.micro_batch_size,
        recompute=cfg.recompute.granularity,
    )


@dataclass(frozen=True)
class Fit:
    """The planner's memory for the recipe's layout here, against what one process has."""

    layout: Layout
    need: float  # bytes, worst rank
    have: float  # bytes per process
    have_text: str

    @property
    def clearly_too_big(self) -> bool:
        return self.need > FIT_MARGIN * self.have


def estimate_fit(cfg: SuiteConfig, dims: ParallelDims) -> Fit | None:
    """The cost model's memory for the recipe as launched here; None when the cluster group cannot
    cost the recipe's precision (no peak_flops for it), so there is no planner answer."""
    if cfg.train.precision not in cfg.cluster.peak_flops:
        return None
    cluster = replace(cfg.cluster, nodes=cfg.launch.nnodes, devices_per_node=nproc_range(cfg)[1])
    job = replace(Job.from_config(cfg), cluster=replace(cluster, device_type=run_device(cfg)))
    layout = recipe_layout(cfg, dims)
    have, text = device_memory(cfg)
    return Fit(layout, evaluate(job, layout).memory.total, have, text)


def plan_command(cfg: SuiteConfig, overrides: list[str], nodes: int) -> str:
    """The `suite plan` line that shows the table for the same job on `nodes` of the cluster group."""
    keep = [
        o
        for o in overrides
        if any(o.split("=", 1)[0] == k or o.startswith(k + ".") for k in PLAN_KEYS)
        and not o.startswith("cluster.nodes=")
    ]
    if not any(o.startswith("cluster=") for o in keep):
        keep.append(f"cluster={cfg.cluster.name}")
    return " ".join(["suite plan", *keep, f"cluster.nodes={nodes}"])


def check_fits(cfg: SuiteConfig, dims: ParallelDims, overrides: list[str]) -> Fit | None:
    """ConfigError (one line) when the recipe clearly cannot fit here: the planner's memory per
    process, and the smallest cluster of the cluster group it would need. Returns the estimate."""
    fit = estimate_fit(cfg, dims)
    if fit is None or not fit.clearly_too_big:
        return fit
    nproc = nproc_range(cfg)[1]
    c = cfg.cluster
    nodes = smallest_cluster(replace(job_of(cfg), cluster=replace(c, nodes=1)))
    if nodes is None:
        need = f"no cluster of up to 4096 x {c.devices_per_node} {c.name} holds it"
        table = plan_command(cfg, overrides, 1)
    else:
        need = (
            f"it needs at least {nodes * c.devices_per_node} x {c.name} "
            f"(cluster={c.name} cluster.nodes={nodes}, {c.devices_per_node} per node)"
        )
        table = plan_command(cfg, overrides, nodes)
    gpus = "; for GPUs pass e.g. cluster=h100-80g" if c.device_type == "cpu" else ""
    here = f", {fit.need * nproc / GIB:.0f} GiB for this node's {nproc}" if nproc > 1 else ""
    raise ConfigError(
        f"recipe {cfg.recipe_name} (model {cfg.model.name}) runs world size {dims.world_size} = "
        f"launch.nnodes={cfg.launch.nnodes} x launch.nproc_per_node={nproc}: "
        f"{count_params(cfg.model) / 1e9:.2f}B parameters as {fit.layout.name} need about {fit.need / GIB:.1f} "
        f"GiB per process{here} (the planner's weights, gradients, optimizer state and activations), "
        f"but {fit.have_text}; {need}; `{table}` for the table{gpus}"
    )
