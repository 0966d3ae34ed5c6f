"""One frozen object that owns the parallel degrees, checks them, and builds the device mesh."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, ParallelConfig, SuiteConfig
from suite.config.validate import nproc_range
from suite.models.transformer import ffn_size
from suite.parallel.expert_parallel import check_expert_parallel
from suite.parallel.hierarchical_dispatch import check_ep_dispatch
from suite.parallel.mesh import build_mesh

# Mesh dimension order, outermost first: pp spans nodes, tp stays inside a node (suite.parallel.mesh).
MESH_ORDER = ("pp", "dp", "sharding", "cp", "tp")
DEGREE_KEYS = ("dp", "sharding", "tp", "pp", "cp")
# parallel.pp_schedule's names (suite.parallel.pipeline.SCHEDULES maps each to its schedule class);
# the multi-stage ones place parallel.vpp stages on each rank
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def _as_degree(key: str, value: object) -> int | None:
    if value == "auto" or value is None:
        return None
    try:
        degree = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(
            f"parallel.{key}={value!r} is not a degree; use a positive integer or 'auto'"
        ) from None
    if degree < 1:
        raise ConfigError(f"parallel.{key}={degree} must be at least 1 (or 'auto')")
    return degree


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    sharding: int
    tp: int
    pp: int
    cp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve 'auto' degrees against the world size and check they multiply to it."""
        degrees = {key: _as_degree(key, getattr(cfg, key)) for key in DEGREE_KEYS}
        autos = [k for k, v in degrees.items() if v is None]
        fixed = 1
        for v in degrees.values():
            fixed *= v or 1
        if len(autos) > 1:
            raise ConfigError(
                f"parallel: {' and '.join('parallel.' + k for k in autos)} are all 'auto'; at most one degree may be 'auto'"
            )
        if autos:
            if world_size % fixed:
                raise ConfigError(
                    f"parallel.{autos[0]}=auto: the other degrees multiply to {fixed}, which does not divide "
                    f"the world size {world_size}; pick degrees whose product divides it"
                )
            degrees[autos[0]] = world_size // fixed
        product = 1
        for v in degrees.values():
            product *= v  # type: ignore[operator]
        if product != world_size:
            desc = "*".join(f"{k}={degrees[k]}" for k in DEGREE_KEYS if degrees[k] != 1) or "all 1"
            raise ConfigError(
                f"parallel degrees {desc} multiply to {product} but the world size "
                f"(launch.nnodes * launch.nproc_per_node) is {world_size}; make them equal, or set one degree to 'auto'"
                + (
                    f" (parallel.ep={cfg.ep} is no degree of its own: expert parallelism borrows the data-parallel "
                    f"ranks, so it needs parallel.dp or parallel.sharding to give {cfg.ep} ranks, e.g. parallel.dp={cfg.ep})"
                    if str(cfg.ep) not in ("1", "auto")
                    else ""
                )
            )
        ep = _as_degree("ep", cfg.ep)
        data_ranks = degrees["dp"] * degrees["sharding"]  # type: ignore[operator]
        if ep is None:
            ep = data_ranks
        return cls(world_size=world_size, ep=ep, **degrees)  # type: ignore[arg-type]

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples (replicated x sharded data parallel)."""
        return self.dp * self.sharding

    @property
    def enabled(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER if getattr(self, name) > 1}

    def validate(self, cfg: ParallelConfig, model: ModelConfig) -> None:
        """Check the degrees against the model and the batch sizes."""
        kv = model.num_kv_heads or model.num_heads
        if model.num_heads % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp} does not divide model.num_heads={model.num_heads}; "
                f"use a tp that divides {model.num_heads}"
            )
        if kv % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp} does not divide model.num_kv_heads={kv}; use a tp that divides {kv}"
            )
        stages = self.pp * cfg.vpp
        if stages > model.num_layers:
            raise ConfigError(
                f"parallel.pp={self.pp} x parallel.vpp={cfg.vpp} = {stages} stages exceed model.num_layers="
                f"{model.num_layers}; use at most {model.num_layers} stages"
            )
        if self.pp > 1 and model.num_layers % stages:
            raise ConfigError(
                f"model.num_layers={model.num_layers} is not divisible by parallel.pp*parallel.vpp={stages}; "
                "pick pp and vpp whose product divides the layer count"
            )
        if cfg.vpp > 1 and self.pp == 1:
            raise ConfigError(f"parallel.vpp={cfg.vpp} needs parallel.pp > 1; set parallel.vpp=1 or raise pp")
        if cfg.micro_batch_size < 1:
            raise ConfigError(f"parallel.micro_batch_size={cfg.micro_batch_size} must be at least 1")
        per_step = cfg.micro_batch_size * self.data_parallel_size
        if cfg.global_batch_size % per_step:
            raise ConfigError(
                f"parallel.global_batch_size={cfg.global_batch_size} is not divisible by "
                f"parallel.micro_batch_size={cfg.micro_batch_size} x data-parallel size {self.data_parallel_size}"
                f" = {per_step}; use a multiple of {per_step}"
            )
        if cfg.sharding_stage not in (1, 2, 3):
            raise ConfigError(f"parallel.sharding_stage={cfg.sharding_stage} is not a stage; use 1, 2 or 3")
        if cfg.sp and self.tp == 1:
            raise ConfigError(
                "parallel.sp=true needs parallel.tp > 1 (sequence parallel splits along tp ranks)"
            )

    def validate_run(self, cfg: SuiteConfig) -> None:
        """Checks that need more than the parallel and model groups (sequence, precision, launch)."""
        model, pcfg = cfg.model, cfg.parallel
        if self.cp > 1:
            check_context_parallel(self, cfg)
        if model.num_experts > 0 or self.ep > 1:
            check_expert_parallel(self, cfg)
        check_ep_dispatch(self, cfg)
        if self.tp > 1:
            for key, size in (
                ("model.vocab_size", model.vocab_size),
                ("the MLP width (model.ffn_hidden_size)", ffn_size(model)),
            ):
                if size % self.tp:
                    raise ConfigError(
                        f"parallel.tp={self.tp} does not divide {key}={size}; tensor parallelism splits it evenly, "
                        f"use a tp that divides {size} (or pad it to a multiple of {self.tp})"
                    )
        if pcfg.sp and cfg.data.seq_len % self.tp:
            raise ConfigError(
                f"parallel.sp=true splits the sequence across parallel.tp={self.tp} ranks but data.seq_len="
                f"{cfg.data.seq_len} is not divisible by {self.tp}; use a multiple of {self.tp}"
            )
        if pcfg.offload and self.world_size > 1 and (self.sharding == 1 or pcfg.sharding_stage == 1):
            raise ConfigError(
                "parallel.offload=true offloads sharded parameters, gradients and optimizer state (FSDP); "
                f"it needs parallel.sharding>1 with parallel.sharding_stage 2 or 3 (got sharding={self.sharding}, "
                f"stage {pcfg.sharding_stage}), or a single process"
            )
        if pcfg.fsdp_forward_prefetch < 0 or pcfg.fsdp_backward_prefetch < 1:
            raise ConfigError(
                f"parallel.fsdp_forward_prefetch={pcfg.fsdp_forward_prefetch} and parallel.fsdp_backward_prefetch="
                f"{pcfg.fsdp_backward_prefetch}: use counts of blocks, >= 0 forward and >= 1 backward (defaults 0, 1)"
            )
        explicit_prefetch = pcfg.fsdp_forward_prefetch > 0 or pcfg.fsdp_backward_prefetch > 1
        if explicit_prefetch and (self.sharding == 1 or pcfg.sharding_stage == 1):
            raise ConfigError(
                "parallel.fsdp_forward_prefetch / fsdp_backward_prefetch set FSDP2's all-gather prefetching; they "
                f"need parallel.sharding>1 with parallel.sharding_stage 2 or 3 (got sharding={self.sharding}, "
                f"stage {pcfg.sharding_stage})"
            )
        tied_mtp = bool(cfg.model.num_mtp_layers and cfg.model.tie_embeddings)
        check_pipeline(pcfg, self, cfg.train.compile is True, tied_mtp)
        launch = cfg.launch
        if not 0 <= launch.node_rank < launch.nnodes:
            raise ConfigError(
                f"launch.node_rank={launch.node_rank} is not in [0, launch.nnodes={launch.nnodes}); "
                "number the nodes 0..nnodes-1"
            )
        if launch.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts={launch.max_restarts} must be >= 0")
        if self.world_size == 1:
            return
        wants_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
        if launch.backend == "nccl" and not wants_gpu:
            raise ConfigError(
                "launch.backend=nccl needs GPUs (train.device=cuda); use launch.backend=gloo or auto on CPU"
            )
        if cfg.train.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no GPU is visible; use train.device=auto or cpu")
        if wants_gpu:
            per_node = self.world_size // launch.nnodes
            if per_node > torch.cuda.device_count():
                raise ConfigError(
                    f"launch.nproc_per_node={per_node} exceeds the {torch.cuda.device_count()} GPUs of this node; "
                    f"use at most {torch.cuda.device_count()} processes per node"
                )

    def build_mesh(self, device_type: str):
        """The job's named DeviceMesh (collective; needs the process group)."""
        return build_mesh(self, device_type)

    def accumulation(self, cfg: ParallelConfig) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return cfg.global_batch_size // (cfg.micro_batch_size * self.data_parallel_size)

    @cached_property
    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        names = tuple(n for n in MESH_ORDER if getattr(self, n) > 1) or ("dp",)
        return names, tuple(getattr(self, n) for n in names)


def resolve_dims(cfg: SuiteConfig, world: int) -> ParallelDims:
    """The parallel degrees for `world` processes, checked against the model, batch and launch."""
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.validate(cfg.parallel, cfg.model)
    dims.validate_run(cfg)
    return dims


def elastic_world_sizes(cfg: SuiteConfig) -> list[int]:
    """World sizes an elastic job (launch.nproc_per_node=min:max) can run on, largest first:
    those in [min, max] for which the parallel degrees resolve (e.g. dp or sharding 'auto' with a
    global batch they divide)."""
    low, high = nproc_range(cfg)
    sizes = []
    for world in range(high, low - 1, -1):
        try:
            resolve_dims(cfg, world)
        except ConfigError:
            continue
        sizes.append(world)
    return sizes


def check_elastic(cfg: SuiteConfig) -> None:
    """An elastic range must be able to run at its minimum: fixed degrees that need more reject."""
    low, high = nproc_range(cfg)
    if low == high:
        return
    value = cfg.launch.nproc_per_node
    if cfg.launch.nnodes > 1:
        raise ConfigError(
            f"launch.nproc_per_node={value}: an elastic process range works on one node (launch.nnodes=1); "
            f"with launch.nnodes={cfg.launch.nnodes} use a fixed count like launch.nproc_per_node={high}"
        )
    try:
        resolve_dims(cfg, low)
    except ConfigError as exc:
        raise ConfigError(
            f"launch.nproc_per_node={value} may shrink the job to {low} processes, but there: {exc}; "
            "let one degree follow the world size (parallel.sharding=auto or parallel.dp=auto) or raise the minimum"
        ) from None


def check_context_parallel(dims: ParallelDims, cfg: SuiteConfig) -> None:
    """One-line errors for context-parallel settings that cannot run (cp > 1)."""
    cp, seq_len = dims.cp, cfg.data.seq_len
    if seq_len % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp} cuts data.seq_len={seq_len} into 2*cp={2 * cp} load-balanced chunks, but "
            f"{seq_len} is not divisible by {2 * cp}; use a data.seq_len that is a multiple of {2 * cp}"
        )
    if cfg.parallel.sp and (seq_len // cp) % dims.tp:
        raise ConfigError(
            f"parallel.sp=true splits each cp rank's data.seq_len/parallel.cp={seq_len // cp} tokens across "
            f"parallel.tp={dims.tp} ranks, which does not divide them; use a data.seq_len that is a multiple "
            f"of {2 * cp * dims.tp}"
        )


# ---- pipeline checks ---------------------------------------------------------------------------
def check_pipeline(
    cfg: ParallelConfig, dims: ParallelDims, compile_blocks: bool, tied_mtp: bool = False
) -> None:
    """One-line errors for pipeline settings the schedules cannot run (called once, by
    ParallelDims.validate_run, before any process starts; the schedule name is checked at any pp).
    tied_mtp: multi-token prediction with a tied head (the last stage's one embedding weight feeds
    both the MTP modules' input and the head)."""
    schedule = cfg.pp_schedule
    if schedule not in PP_SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={schedule!r} is not a schedule; use one of {', '.join(PP_SCHEDULES)}"
        )
    if dims.pp == 1:
        return
    if schedule in MULTI_STAGE and cfg.vpp < 2:
        raise ConfigError(f"parallel.pp_schedule={schedule} needs parallel.vpp >= 2 virtual stages per rank")
    if schedule not in MULTI_STAGE and cfg.vpp != 1:
        raise ConfigError(
            f"parallel.pp_schedule={schedule} runs one stage per rank but parallel.vpp={cfg.vpp}; "
            "set parallel.vpp=1 or use parallel.pp_schedule=interleaved_1f1b"
        )
    n = dims.accumulation(cfg)
    per_step = f"global_batch_size/(micro_batch_size*data-parallel size) = {n} micro-batches per step"
    if schedule == "1f1b" and n < dims.pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={dims.pp} micro-batches per step, got {per_step}; "
            "raise parallel.global_batch_size or lower parallel.micro_batch_size"
        )
    if schedule in MULTI_STAGE and n % max(1, n // dims.pp):
        raise ConfigError(
            f"parallel.pp_schedule={schedule} needs the micro-batches per step to split into equal rounds of "
            f"parallel.pp={dims.pp}, got {per_step}; use a multiple of {dims.pp}"
        )
    if schedule == "zero_bubble" and tied_mtp:
        raise ConfigError(
            "parallel.pp_schedule=zero_bubble with model.num_mtp_layers>0 and model.tie_embeddings=true: the "
            "last stage's one embedding weight feeds both the MTP modules and the head, which zero bubble's "
            "separate weight-gradient pass cannot run twice; use parallel.pp_schedule=interleaved_1f1b or "
            "model.tie_embeddings=false"
        )
    if schedule == "zero_bubble" and compile_blocks:
        raise ConfigError(
            "parallel.pp_schedule=zero_bubble splits backward into input and weight passes, which "
            "torch.compile'd blocks do not support; set train.compile=false or use interleaved_1f1b"
        )
