"""Exact parameter counts: every tensor of the model by name and shape, read off the blocks the
trainer builds (on the meta device, for any registered family), then split the way suite.parallel
places it.

- pipeline: the trainer's own stage split (suite.parallel.pipeline.split_layers, balanced by
  parameter count); the first stage holds the token (and position) embeddings, the last the final
  norm and the head, and with tied embeddings and pp > 1 the head is a second copy of the
  embedding (Megatron's embedding group).
- tensor parallel (suite.parallel.tensor_parallel): column-parallel wq/wk/wv/wqkv/w1/w3/w13 and the
  vocabulary-parallel embedding and head split dim 0, row-parallel wo/w2 split dim 1 (their biases
  and the norms and position table are replicated).
- expert parallel: the stacked expert weights [E, ...] split dim 0 over ep, and are not sharded
  further (suite.parallel.expert_parallel); at ep = 1 FSDP shards them like any tensor. Under tp
  they also split their ffn dim (w1 / w3 dim 1, w2 dim 2: suite.parallel.expert_tensor_parallel);
  the router is replicated.
- sharding (FSDP2, ZeRO): dim 0 of each rank's tensor is cut like torch.chunk, so ranks can hold
  unequal pieces; the worst rank is the first.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from suite.config.schema import ModelConfig
from suite.models.moe import moe_layer_ids
from suite.models.mtp import mtp_config
from suite.models.transformer import Transformer, TransformerBlock
from suite.parallel.expert_tensor_parallel import shared_expert_plan
from suite.parallel.pipeline import split_layers
from suite.parallel.tensor_parallel import block_plan


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name in the plain model, its full shape, the dim tensor parallelism
    splits (None: replicated over tp), whether it is a stacked expert tensor, and its layer (None:
    embeddings, final norm, head)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    expert: bool = False
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_CACHE: dict[tuple, object] = {}  # keyed by repr(ModelConfig) (a mutable dataclass: not hashable)

# the stacked expert tensors [E, ...]: which dim expert tensor parallelism splits (the ffn width;
# suite.parallel.expert_tensor_parallel), dim 0 being the experts expert parallelism splits
EXPERT_TP_DIMS = {"w1": 1, "w3": 1, "w2": 2}


def _tp_dims(cfg: ModelConfig, moe: bool) -> dict[str, int]:
    """Parameter name (in a block) -> the dim tensor parallelism splits, read off the plan the trainer
    applies (suite.parallel.tensor_parallel.block_plan): column-parallel weights and biases dim 0,
    row-parallel weights dim 1; everything else is replicated."""
    plan = dict(block_plan(False, cfg, moe))
    if moe and cfg.num_shared_experts:
        plan |= {f"feed_forward.{key}": style for key, style in shared_expert_plan(cfg).items()}
    dims: dict[str, int] = {}
    for key, style in plan.items():
        if isinstance(style, ColwiseParallel):
            dims[f"{key}.weight"] = dims[f"{key}.bias"] = 0
        elif isinstance(style, RowwiseParallel):
            dims[f"{key}.weight"] = 1
    return dims


def _block_specs(cfg: ModelConfig, moe: bool) -> tuple[tuple[str, tuple[int, ...], int | None, bool], ...]:
    """(name in the block, shape, tp dim, expert) of a dense or MoE block, from the block the trainer
    builds (on the meta device: no memory), so every family is counted as it is built."""
    key = ("block", repr(cfg), moe)
    if key not in _CACHE:
        layer = (
            moe_layer_ids(cfg)[0]
            if moe
            else next(i for i in range(cfg.num_layers) if i not in moe_layer_ids(cfg))
        )
        with torch.device("meta"):
            block = TransformerBlock(cfg, layer)
        tp_dims = _tp_dims(cfg, moe)
        specs = []
        for name, param in block.named_parameters():
            expert = ".experts." in name
            tp_dim = EXPERT_TP_DIMS[name.rsplit(".", 1)[1]] if expert else tp_dims.get(name)
            specs.append((name, tuple(param.shape), tp_dim, expert))
        _CACHE[key] = tuple(specs)
    return _CACHE[key]  # type: ignore[return-value]


def layer_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    """One TransformerBlock's tensors (attention, norms, MLP or MoE), in the model's order."""
    moe = layer in moe_layer_ids(cfg)
    return [
        ParamSpec(f"layers.{layer}.{name}", shape, tp_dim, expert=expert, layer=layer)
        for name, shape, tp_dim, expert in _block_specs(cfg, moe)
    ]


def _outer_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The embeddings, final norm and head of the model the trainer builds (a tied head once, as
    `output.weight`): the token embedding and head vocabulary-parallel, the rest replicated."""
    key = ("outer", repr(cfg))
    if key not in _CACHE:
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(cfg, num_layers=0, moe_layers=None))
        specs = {
            name: ParamSpec(name, tuple(p.shape), 0 if name == "tok_embeddings.weight" else None)
            for name, p in model.named_parameters()
        }
        specs["output.weight"] = ParamSpec("output.weight", (cfg.vocab_size, cfg.hidden_size), 0)
        _CACHE[key] = specs
    return _CACHE[key]  # type: ignore[return-value]


def embedding_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Token embedding [V, h] (vocabulary-parallel) and, for learned positions, the position table."""
    return [s for name, s in _outer_specs(cfg).items() if name.endswith("embeddings.weight")]


def head_specs(cfg: ModelConfig, separate_copy: bool) -> list[ParamSpec]:
    """Final norm and the output head [V, h]; a tied head is its own tensor only when `separate_copy`
    (a pipeline's last stage), otherwise it is the embedding."""
    specs = [s for name, s in _outer_specs(cfg).items() if name.startswith("norm.")]
    if not cfg.tie_embeddings or separate_copy:
        specs.append(_outer_specs(cfg)["output.weight"])
    return specs


def mtp_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The multi-token prediction modules' tensors (suite.models.mtp): each module's dense block split
    by tensor parallelism as the model's dense blocks are, its norms and projection replicated
    (suite.parallel.tensor_parallel.mtp_plan)."""
    if not cfg.num_mtp_layers:
        return []
    block_dims = _tp_dims(mtp_config(cfg), moe=False)
    specs = []
    for name, spec in _outer_specs(cfg).items():
        if name.startswith("mtp."):
            inner = name.split(".block.", 1)[1] if ".block." in name else None
            specs.append(dataclasses.replace(spec, tp_dim=block_dims.get(inner) if inner else None))
    return specs


def last_stage_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """What a pipeline's last stage holds beyond its layers: the final norm and its own head (a tied
    head copied), and with multi-token prediction the MTP modules and the token embedding they read
    (its own copy where the head is untied; a tied head is that copy already:
    suite.parallel.pipeline.make_stage_part)."""
    specs = head_specs(cfg, separate_copy=True) + mtp_specs(cfg)
    if cfg.num_mtp_layers and not cfg.tie_embeddings:
        specs += [s for s in embedding_specs(cfg) if s.name == "tok_embeddings.weight"]
    return specs


def model_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every distinct tensor of the single-process model (a tied head counted once)."""
    specs = embedding_specs(cfg)
    for layer in range(cfg.num_layers):
        specs += layer_specs(cfg, layer)
    return specs + head_specs(cfg, separate_copy=False) + mtp_specs(cfg)


def count_params(cfg: ModelConfig, position_embeddings: bool = True) -> int:
    """Total parameters: sum of numel over model_specs. Transformer.num_params() leaves out the
    position table (position_embeddings=False gives its number)."""
    return sum(s.numel for s in model_specs(cfg) if position_embeddings or not s.name.startswith("pos_"))


def stage_layers(cfg: ModelConfig, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Layer ids of each pipeline stage: the trainer's split (suite.parallel.pipeline.split_layers,
    as plan_stages calls it) computed from the counts alone."""
    key = ("stages", repr(cfg), num_stages)
    if key not in _CACHE:
        costs = [sum(s.numel for s in layer_specs(cfg, i)) for i in range(cfg.num_layers)]
        first = sum(s.numel for s in embedding_specs(cfg))
        last = sum(s.numel for s in last_stage_specs(cfg))
        _CACHE[key] = tuple(tuple(stage) for stage in split_layers(costs, first, last, num_stages))
    return _CACHE[key]  # type: ignore[return-value]


def rank_layers(cfg: ModelConfig, pp: int, vpp: int = 1) -> list[list[int]]:
    """Layer ids each pipeline rank holds (rank r: stages r, r + pp, ...)."""
    if pp == 1:
        return [list(range(cfg.num_layers))]
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for index, layers in enumerate(stage_layers(cfg, pp * vpp)):
        ranks[index % pp] += layers
    return ranks


def stage_specs(cfg: ModelConfig, pp: int, vpp: int = 1) -> list[list[ParamSpec]]:
    """The tensors each pipeline rank holds: rank r owns stages r, r+pp, ... (the looped placement)."""
    if pp == 1:
        return [model_specs(cfg)]
    stages = stage_layers(cfg, pp * vpp)
    ranks: list[list[ParamSpec]] = [[] for _ in range(pp)]
    for index, layers in enumerate(stages):
        specs = ranks[index % pp]
        if index == 0:
            specs += embedding_specs(cfg)
        for layer in layers:
            specs += layer_specs(cfg, layer)
        if index == len(stages) - 1:
            specs += last_stage_specs(cfg)
    return ranks


def chunk(rows: int, parts: int, index: int) -> int:
    """Rows of piece `index` when `rows` are cut like torch.chunk: ceil(rows/parts) per piece, the
    last ones shorter or empty."""
    size = math.ceil(rows / parts) if rows else 0
    return max(0, min(size, rows - index * size))


def local_shape(spec: ParamSpec, tp: int, ep: int) -> tuple[int, ...]:
    """The shape a rank holds after tensor and expert parallelism (each divides its dim exactly:
    suite.parallel.dims checks heads, vocabulary, MLP widths and experts against tp and ep)."""
    shape = list(spec.shape)
    if spec.expert:
        shape[0] //= ep
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp
    return tuple(shape)


def rank_numel(specs: list[ParamSpec], tp: int, ep: int, shards: int = 1, index: int = 0) -> int:
    """Parameters rank `index` of `shards` holds at rest: the tp/ep-local tensors, each cut on dim 0
    into `shards` pieces (FSDP2's Shard(0)); under ep > 1 expert tensors are not sharded further
    (expert parallelism keeps them out of FSDP), at ep = 1 FSDP shards them like the rest."""
    total = 0
    for spec in specs:
        shape = local_shape(spec, tp, ep)
        rest = math.prod(shape[1:])
        if (spec.expert and ep > 1) or shards == 1:
            total += shape[0] * rest
        else:
            total += chunk(shape[0], shards, index) * rest
    return total


@dataclass(frozen=True)
class RankParams:
    """Parameters of one pipeline rank, before and after sharding (worst sharding rank)."""

    pp_rank: int
    unsharded: int  # tp/ep-local parameters of this rank's stages
    sharded: int  # what it keeps at rest when parameters are sharded (worst sharding rank)
    shardable: int  # of `unsharded`, those FSDP shards (not expert tensors)


def pp_rank_params(cfg: ModelConfig, pp: int, vpp: int, tp: int, ep: int, shards: int) -> list[RankParams]:
    """Every pipeline rank's parameters, counted exactly (see rank_numel)."""
    key = ("ranks", repr(cfg), pp, vpp, tp, ep, shards)
    if key not in _CACHE:
        table = []
        for rank, specs in enumerate(stage_specs(cfg, pp, vpp)):
            unsharded = rank_numel(specs, tp, ep)
            sharded = rank_numel(specs, tp, ep, shards, 0)
            shardable = sum(math.prod(local_shape(s, tp, ep)) for s in specs if not (s.expert and ep > 1))
            table.append(RankParams(rank, unsharded, sharded, shardable))
        _CACHE[key] = table
    return _CACHE[key]  # type: ignore[return-value]


def worst_rank_params(cfg: ModelConfig, pp: int, vpp: int, tp: int, ep: int, shards: int) -> RankParams:
    """The pipeline rank with the most parameters."""
    return max(pp_rank_params(cfg, pp, vpp, tp, ep, shards), key=lambda r: r.unsharded)
