"""`parallelize`: the one place where a plain model becomes a parallel one.

It returns a Placement (suite.parallel.placement): what this rank holds (the model or its pipeline
stage parts, the mesh and groups, the data-parallel kind) and the communication that layout implies.
It runs nothing: the step (forward/backward, accumulation or the pipeline schedule, clipping, the
optimizer) lives in suite.train.step and reads the placement (torchtitan's split: parallelism
applied from outside).

Order of application (each step sees the previous one's result; the model starts on `meta`):

    0. float8 linears (train.precision=fp8)    torchao Float8Linear, suite.models.float8
    1. tensor parallel (+ sequence parallel)   DTensor plans, suite.parallel.tensor_parallel
       context parallel                        cp-aware attention, suite.parallel.context_parallel
    2. activation recompute                    suite.parallel.recompute.apply_recompute
    3. torch.compile per block                 train.compile (in place: names stay the same)
    4. data parallel                           replicate / ZeRO-1 / FSDP2 stage 2-3 / HSDP (+offload)
    5. materialise                             allocate shards, seeded init = the one-process values
   (pp > 1: suite.parallel.pipeline.build_pipeline first cuts the model into this rank's stage
    part(s) and runs 1-5 on each part through the `parallelize_part` callback.)

TP comes first because FSDP shards the TP-local tensors (2-D DTensors); recompute and compile wrap
the TP-rewritten blocks; FSDP is last among the rewrites so its hooks sit outside the recomputed
and compiled regions and gather the parameters once per block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.models.family import family_of
from suite.models.float8 import prepare_float8
from suite.parallel import data_parallel as dpar
from suite.parallel import expert_parallel as ep
from suite.parallel.context_parallel import apply_context_parallel
from suite.parallel.dims import ParallelDims
from suite.parallel.env import init_single_process_group
from suite.parallel.hierarchical_dispatch import apply_hierarchical_dispatch
from suite.parallel.mesh import data_rank
from suite.parallel.pipeline import build_pipeline
from suite.parallel.placement import Placement
from suite.parallel.recompute import apply_recompute
from suite.parallel.tensor_parallel import apply_tensor_parallel, keep_gradient_layouts
from suite.runtime import PrecisionPolicy


def _apply_recompute(model: nn.Module, cfg: SuiteConfig) -> None:
    apply_recompute(model, cfg.recompute)


# train.compile=auto: the smallest width where compiling paid (docs/performance.md)
COMPILE_AUTO_MIN_HIDDEN = 512


def compile_enabled(
    cfg: SuiteConfig, dims: ParallelDims, device: torch.device, precision: PrecisionPolicy
) -> bool:
    """train.compile: true / false as set; `auto` compiles each block where it paid when measured
    (docs/performance.md): Llama-family blocks (RMSNorm, RoPE, SwiGLU: elementwise work that the
    compiled block fuses) at width >= COMPILE_AUTO_MIN_HIDDEN: on CPU in any precision (bf16: -16%
    time; fp32: even time, -20% peak memory), on GPUs in bf16 or fp16. GPT blocks measured no faster
    compiled on CPU, and small models stay eager: a minute of compilation per process outweighs what
    fusing saves there. Not under the zero-bubble pipeline schedule, which compiled blocks do
    not support (true is rejected there), nor under context parallelism: there `true` compiles each
    block around its eager cp attention (two graphs per block, suite.parallel.context_parallel),
    which measured no faster on CPU at width 512 (docs/parallelism.md), so auto leaves it off."""
    value = cfg.train.compile
    if value != "auto":
        return bool(value)
    if dims.cp > 1 or (dims.pp > 1 and cfg.parallel.pp_schedule == "zero_bubble"):
        return False
    low_precision = precision.low_precision
    return (
        family_of(cfg.model).compile_auto
        and cfg.model.hidden_size >= COMPILE_AUTO_MIN_HIDDEN
        and (device.type == "cpu" or (device.type == "cuda" and low_precision))
    )


def _compile_blocks(model: nn.Module) -> None:
    for block in model.layers.values():
        block.compile()  # in place: parameter names (and so checkpoints) stay the same


def make_part_parallelizer(
    cfg: SuiteConfig,
    dims: ParallelDims,
    mesh,
    device: torch.device,
    precision: PrecisionPolicy,
    materialize: bool = True,
) -> tuple[Callable[[nn.Module], nn.Module], dict]:
    """The callback that turns one meta-device model part into this rank's runnable, initialised part
    (`materialize=False`: placed but left on the meta device, what `suite pretrain --dry-run` reads).

    Returns (callback, info); info gets `dp_kind`, `optim_device` and `compute_device` once the
    callback has run (the same for every part).
    """
    info: dict = {}
    pcfg = cfg.parallel

    compiled = compile_enabled(cfg, dims, device, precision)

    def parallelize_part(part: nn.Module) -> nn.Module:
        if dims.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], pcfg.sp, compiled_blocks=compiled)
        if dims.cp > 1:
            apply_context_parallel(part, mesh["cp"])
        expert_params: list = []
        if dims.ep > 1:
            ep_mesh = ep.build_expert_mesh(dims, device.type)
            expert_params = ep.apply_expert_parallel(
                part, ep_mesh, info.setdefault("ep_traffic", {"bytes": 0, "internode": 0})
            )
            # offload: the flat dispatch (runs the experts' forward, where FSDP gathers them)
            dispatch = "flat" if pcfg.offload else pcfg.ep_dispatch
            apply_hierarchical_dispatch(part, dims, device.type, dispatch)
            if not pcfg.offload:  # offload: FSDP reduces them (ep.shard_experts below)
                info.setdefault("after_backward", []).append(  # one per part (pipeline stages)
                    lambda: ep.reduce_expert_grads(
                        ep.expert_params_of(part), ep_mesh, dims.data_parallel_size * dims.cp
                    )
                )
        _apply_recompute(part, cfg)
        if compiled:
            _compile_blocks(part)
        if dims.ep > 1 and pcfg.offload:  # experts: their own FSDP group on the expert mesh, offloaded
            ep.shard_experts(
                part,
                ep_mesh,
                reshard_after_forward=pcfg.sharding_stage == 3,
                mp_policy=dpar.mixed_precision(precision),
                offload_policy=dpar.offload_policy(True, device),
                average_size=dims.data_parallel_size * dims.cp,
            )
            expert_params = []  # FSDP-managed now: the dense groups skip them
        kind = dpar.apply_data_parallel(
            part,
            mesh,
            dims,
            pcfg.sharding_stage,
            precision,
            pcfg.offload,
            device,
            ignored_params=set(expert_params),
            forward_prefetch=pcfg.fsdp_forward_prefetch,
            backward_prefetch=pcfg.fsdp_backward_prefetch,
        )
        # offloaded FSDP keeps the sharded parameters (and so the optimizer) on the CPU
        home = torch.device("cpu") if pcfg.offload else device
        if materialize:
            dpar.materialize_parallel(part, home, cfg.train.seed, buffer_device=device)
        if (
            materialize and kind == "none" and dims.tp > 1
        ):  # after materialising: hooks live on the final parameters
            keep_gradient_layouts(part)
        info.update(dp_kind=kind, optim_device=home, compute_device=device)
        return part

    return parallelize_part, info


def parallelize(
    model: nn.Module,
    cfg: SuiteConfig,
    dims: ParallelDims,
    device: torch.device,
    precision: PrecisionPolicy,
    materialize: bool = True,
) -> Placement:
    """Apply the recipe's parallelism to a meta-device model (see the module docstring for the order);
    `materialize=False` leaves the placed parameters on the meta device (a dry run)."""
    num_params = model.num_params()
    prepare_float8(model, precision)  # train.precision=fp8: Float8Linear before any wrapping
    if dims.world_size == 1 and cfg.parallel.offload:
        init_single_process_group(device)  # FSDP2 (the offload engine) needs a process group
    elif dims.world_size == 1:
        _apply_recompute(model, cfg)
        if compile_enabled(cfg, dims, device, precision):
            _compile_blocks(model)
        return Placement(model=model, dims=dims, num_params=num_params, param_dtype=precision.param_dtype)

    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        got = dist.get_world_size() if dist.is_initialized() else 1
        raise ConfigError(
            f"this job has {got} processes but the config asks for {dims.world_size} "
            "(launch.nnodes x launch.nproc_per_node); start it with `suite pretrain ... launch.nproc_per_node=N` "
            "or make the launch keys match torchrun's"
        )
    mesh = dims.build_mesh(device.type)
    parallelize_part, info = make_part_parallelizer(cfg, dims, mesh, device, precision, materialize)
    if dims.pp > 1:
        placement = build_pipeline(model, cfg, dims, mesh, device, parallelize_part, precision.param_dtype)
        placement.ep_traffic = info.get("ep_traffic")  # expert parallel inside the stages
        placement.gradient_hooks += info.get("after_backward", [])
        return placement
    model = parallelize_part(model)
    return Placement(
        model=model,
        dims=dims,
        dp_rank=data_rank(mesh),
        cp_rank=mesh.get_local_rank("cp"),
        materialized=materialize,
        num_params=num_params,
        mesh=mesh,
        loss_parallel=dims.tp > 1,
        param_dtype=precision.param_dtype,
        dp_kind=info["dp_kind"],
        optim_device=info["optim_device"],
        compute_device=info["compute_device"],
        ep_traffic=info.get("ep_traffic"),
        gradient_hooks=info.get("after_backward", []),
    )
