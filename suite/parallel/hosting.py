"""Can this machine host its share of the job? Checked in the parent, before data preparation and
before any worker starts, so a recipe written for a cluster stops in seconds with one line.

- GPUs: a job on CUDA needs one GPU per process of this node (`launch.nproc_per_node`).
- Memory: a first estimate of the model state each process holds (parameters, gradients, AdamW
  state, fp32 master weights; split by tp x pp, and by the sharding degree as far as its stage
  shards) times this node's processes, against the memory there is: each GPU's for CUDA, the
  machine's available RAM for CPU processes. Activations are not counted: a job that passes may
  still run out of memory, one that fails this check certainly would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.config.validate import nproc_range
from suite.models import num_params
from suite.parallel.dims import ParallelDims

GB = 1e9


@dataclass(frozen=True)
class StateEstimate:
    params: int  # in the whole model
    per_process: float  # bytes of model state one process holds
    detail: str  # how the bytes per parameter add up


def estimate_state(cfg: SuiteConfig, dims: ParallelDims) -> StateEstimate:
    """Bytes of parameters + gradients + optimizer state per process (see the module docstring)."""
    params = num_params(cfg.model)
    weight = 2 if cfg.train.param_dtype == "bf16" else 4
    master = 4 if cfg.train.param_dtype == "bf16" else 0
    parts = {"weights": weight, "gradients": weight, "AdamW state": 8}
    if master:
        parts["fp32 master weights"] = master
    shard = dims.sharding if dims.sharding > 1 else 1
    stage = cfg.parallel.sharding_stage
    sharded = {"AdamW state", "fp32 master weights"} | ({"gradients"} if stage >= 2 else set())
    sharded |= {"weights"} if stage >= 3 else set()
    per_param = sum(b / shard if name in sharded else b for name, b in parts.items())
    # ep splits only the experts; dividing everything by it keeps the estimate a lower bound
    per_process = params / (dims.tp * dims.pp * dims.ep) * per_param
    split = f"tp={dims.tp} x pp={dims.pp}" + (f" x ep={dims.ep}" if dims.ep > 1 else "")
    split += f", sharding={shard} (stage {stage})" if shard > 1 else ""
    detail = " + ".join(f"{name} {b}" for name, b in parts.items()) + f" bytes per parameter, split {split}"
    return StateEstimate(params, per_process, detail)


def available_ram() -> float:
    """Bytes of memory the machine can still give (MemAvailable; the physical size where unknown)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def _machine(gpus: int) -> str:
    cores = os.cpu_count() or 1
    gpu = f"{gpus} CUDA GPU{'s' if gpus != 1 else ''}" if gpus else "no CUDA GPU"
    return f"this machine has {gpu}, {cores} CPU core{'s' if cores != 1 else ''} and {available_ram() / GB:.0f} GB of memory available"


def check_hosting(cfg: SuiteConfig, dims: ParallelDims) -> StateEstimate:
    """Refuse (ConfigError, one line) a job whose share this machine cannot host; returns the estimate."""
    nproc, nodes = nproc_range(cfg)[1], cfg.launch.nnodes
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and gpus > 0)
    job = (
        f"recipe {cfg.recipe_name} (model {cfg.model.name}) runs world size {dims.world_size}"
        f" = launch.nnodes={nodes} x launch.nproc_per_node={nproc}"
    )
    if on_gpu and gpus == 0:  # train.device=cuda
        raise ConfigError(
            f"train.device=cuda, but {_machine(0)}; use train.device=auto (or cpu), or run it "
            f"on a machine with {nproc} GPU{'s' if nproc != 1 else ''}"
        )
    if on_gpu and gpus < nproc:
        raise ConfigError(
            f"{job}: {nproc} processes on this node, one CUDA GPU each, but {_machine(gpus)}; run it where "
            f"each node has {nproc} GPUs, or lower launch.nproc_per_node to {gpus}"
        )
    estimate = estimate_state(cfg, dims)
    need_each = estimate.per_process
    have_each = torch.cuda.get_device_properties(0).total_memory if on_gpu else available_ram() / nproc
    if need_each <= have_each:
        return estimate
    where = "each GPU" if on_gpu else f"this node's {nproc} CPU process{'es' if nproc != 1 else ''}"
    need = need_each if on_gpu else need_each * nproc
    machine = _machine(gpus) + (f" ({have_each / GB:.0f} GB per GPU)" if on_gpu else "")
    cluster = f"run it on {nodes} node(s) x {nproc} GPUs (one process each), " if nproc * nodes > 1 else ""
    raise ConfigError(
        f"{job}: {estimate.params / 1e9:.2f}B parameters need about {need / GB:.0f} GB of parameters, "
        f"gradients and optimizer state on {where} ({estimate.detail}), but {machine}; "
        f"{cluster}shard it over more processes (parallel.tp, parallel.pp, "
        f"parallel.sharding with parallel.sharding_stage=3), or pick a smaller model (e.g. model=gpt-tiny)"
    )
