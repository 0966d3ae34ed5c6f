"""`suite pretrain ... --dry-run`: one rank of the full-size job, built for real on a laptop.

The exact per-rank model is built on the meta device under torch's fake process group of the full
world size (`init_process_group("fake")`: collectives return at once, nothing is sent), and the
trainer's own `parallelize` places it (tensor, context, expert and pipeline parallelism, FSDP)
without materialising anything. The parameters this rank then holds are counted off the model and
set beside the cost model's count (suite.plan.params) for the same rank: they must be equal.
Gradients take the parameters' shapes; AdamW keeps two fp32 moments (and an fp32 master copy of
bf16 parameters) for the parameters this rank updates (ZeRO-1: its row slices).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.models.transformer import build_model
from suite.parallel.dims import MESH_ORDER, MULTI_STAGE, ParallelDims
from suite.parallel.parallelize import parallelize
from suite.parallel.state_bytes import parameter_bytes
from suite.plan.layout import BYTES
from suite.plan.memory import ADAM_STATE_BYTES, MASTER_BYTES
from suite.plan.params import count_params, pp_rank_params, rank_numel, stage_specs
from suite.runtime import resolve_precision


def worst_rank(cfg: SuiteConfig, dims: ParallelDims) -> int:
    """The global rank that holds the most parameters under the cost model: the pipeline rank with
    the most, first in every other axis (the first sharding piece is the largest)."""
    table = pp_rank_params(cfg.model, dims.pp, _vpp(cfg, dims), dims.tp, dims.ep, _shards(dims))
    pp_rank = max(table, key=lambda r: r.sharded).pp_rank
    return pp_rank * (dims.world_size // dims.pp)


def _vpp(cfg: SuiteConfig, dims: ParallelDims) -> int:
    return cfg.parallel.vpp if dims.pp > 1 and cfg.parallel.pp_schedule in MULTI_STAGE else 1


def _shards(dims: ParallelDims) -> int:
    return dims.sharding if dims.sharding > 1 else 1


def coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """A global rank's index on each mesh axis (row-major in MESH_ORDER, as suite.parallel.mesh)."""
    out: dict[str, int] = {}
    for axis in reversed(MESH_ORDER):
        size = getattr(dims, axis)
        out[axis] = rank % size
        rank //= size
    return {axis: out[axis] for axis in MESH_ORDER}


def predicted_numel(cfg: SuiteConfig, dims: ParallelDims, rank: int) -> int:
    """The cost model's parameter count for `rank` at rest (FSDP shards at stages 2 and 3)."""
    at = coordinates(dims, rank)
    specs = stage_specs(cfg.model, dims.pp, _vpp(cfg, dims))[at["pp"]]
    sharded = dims.sharding > 1 and cfg.parallel.sharding_stage >= 2
    shards = dims.sharding if sharded else 1
    return rank_numel(specs, dims.tp, dims.ep, shards, at["sharding"] if sharded else 0)


def _updated_numel(cfg: SuiteConfig, dims: ParallelDims, rank: int, held: int) -> int:
    """Parameters whose optimizer state this rank keeps: all it holds, or under ZeRO-1 its row
    slices (suite.train.zero1: torch.chunk rows of each tp-local tensor over the sharding axis)."""
    if dims.sharding == 1 or cfg.parallel.sharding_stage != 1:
        return held
    at = coordinates(dims, rank)
    specs = stage_specs(cfg.model, dims.pp, _vpp(cfg, dims))[at["pp"]]
    return rank_numel(specs, dims.tp, dims.ep, dims.sharding, at["sharding"])


def dry_run(cfg: SuiteConfig, dims: ParallelDims, rank: int) -> dict:
    """Build and place `rank`'s model under a fake process group; its bytes beside the cost model's."""
    world = dims.world_size
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not a rank of this job; use 0..{world - 1} or --rank worst")
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    precision = resolve_precision(cfg.train)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        model = build_model(cfg.model)  # meta device
        device = torch.device("cpu")
        placement = parallelize(model, cfg, dims, device, precision, materialize=False) if world > 1 else None
        placed = placement.model if placement is not None else model
        held = parameter_bytes(placed) // 4  # meta parameters are fp32 until materialised
    finally:
        dist.destroy_process_group()
    predicted = predicted_numel(cfg, dims, rank)
    param_bytes = BYTES[cfg.train.param_dtype]
    per_state = ADAM_STATE_BYTES + (MASTER_BYTES if param_bytes < 4 else 0)
    updated = _updated_numel(cfg, dims, rank, held)
    return {
        "rank": rank,
        "world_size": world,
        "coordinates": coordinates(dims, rank),
        "params": held,
        "params_predicted": predicted,
        "equal": held == predicted,
        "param_bytes": held * param_bytes,
        "grad_bytes": held * param_bytes,
        "optimizer_bytes": updated * per_state,
        "total_params": count_params(cfg.model),
        "param_dtype": cfg.train.param_dtype,
    }


def report(result: dict) -> str:
    """The dry run in lines: this rank's coordinates, bytes, and the cost model's count beside it."""
    gib = 2**30
    at = ", ".join(f"{k}={v}" for k, v in result["coordinates"].items())
    verdict = (
        "equal" if result["equal"] else f"DIFFERENT by {result['params'] - result['params_predicted']:+,}"
    )
    masters = result.get("param_dtype", "fp32")
    state = "AdamW moments" if masters == "fp32" else f"AdamW moments, fp32 masters of {masters} weights"
    return "\n".join(
        [
            f"dry run: rank {result['rank']} of {result['world_size']} ({at}), built on the meta device "
            "under a fake process group",
            f"  parameters    {result['params']:>16,}  (cost model {result['params_predicted']:,}: {verdict}; "
            f"the model has {result['total_params']:,})",
            f"  weights       {result['param_bytes'] / gib:12.3f} GiB",
            f"  gradients     {result['grad_bytes'] / gib:12.3f} GiB",
            f"  optimizer     {result['optimizer_bytes'] / gib:12.3f} GiB ({state})",
            "nothing was allocated; activations and timings: suite plan ... --explain <layout>",
        ]
    )
