"""Exact parameter counts: every tensor of the model by name and shape, derived from the config the
way suite/models/transformer.py builds it, then split the way suite.parallel places it.

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

import math
from dataclasses import dataclass

from suite.config.schema import ModelConfig


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


def _linear(name: str, out: int, inp: int, bias: bool, kind: str, layer: int) -> list[ParamSpec]:
    """nn.Linear(inp, out): weight [out, inp] (+ bias [out]); kind col splits out, row splits inp."""
    specs = [ParamSpec(f"{name}.weight", (out, inp), 0 if kind == "col" else 1, layer=layer)]
    if bias:
        specs.append(ParamSpec(f"{name}.bias", (out,), 0 if kind == "col" else None, layer=layer))
    return specs


def _norm(cfg: ModelConfig, name: str, layer: int | None) -> list[ParamSpec]:
    """LayerNorm (gpt): weight and bias [h]; RMSNorm (llama): weight [h]."""
    h = cfg.hidden_size
    specs = [ParamSpec(f"{name}.weight", (h,), layer=layer)]
    if cfg.family == "gpt":
        specs.append(ParamSpec(f"{name}.bias", (h,), layer=layer))
    return specs


def _mlp(cfg: ModelConfig, prefix: str, width: int, layer: int) -> list[ParamSpec]:
    """FeedForward: GELU fc/proj with biases (gpt), SwiGLU gate/up/down without (llama)."""
    h, gpt = cfg.hidden_size, cfg.family == "gpt"
    if not gpt and cfg.fused_projections:
        specs = _linear(f"{prefix}.w13", 2 * width, h, False, "col", layer)
    else:
        specs = _linear(f"{prefix}.w1", width, h, gpt, "col", layer)
        if not gpt:
            specs += _linear(f"{prefix}.w3", width, h, False, "col", layer)
    return specs + _linear(f"{prefix}.w2", h, width, gpt, "row", layer)


def layer_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    """One TransformerBlock's tensors (attention, norms, MLP or MoE), in the model's order."""
    from suite.models.moe import expert_ffn_size, moe_layer_ids
    from suite.models.transformer import ffn_size, head_size, kv_heads

    h, gpt = cfg.hidden_size, cfg.family == "gpt"
    p = f"layers.{layer}"
    q_width, kv_width = cfg.num_heads * head_size(cfg), kv_heads(cfg) * head_size(cfg)
    qkv_bias = gpt or cfg.qkv_bias
    specs = _norm(cfg, f"{p}.attention_norm", layer)
    if cfg.fused_projections:
        specs += _linear(f"{p}.attention.wqkv", q_width + 2 * kv_width, h, qkv_bias, "col", layer)
    else:
        specs += _linear(f"{p}.attention.wq", q_width, h, qkv_bias, "col", layer)
        specs += _linear(f"{p}.attention.wk", kv_width, h, qkv_bias, "col", layer)
        specs += _linear(f"{p}.attention.wv", kv_width, h, qkv_bias, "col", layer)
    specs += _linear(f"{p}.attention.wo", h, q_width, gpt, "row", layer)
    specs += _norm(cfg, f"{p}.ffn_norm", layer)
    if layer not in moe_layer_ids(cfg):
        return specs + _mlp(cfg, f"{p}.feed_forward", ffn_size(cfg), layer)
    e, width = cfg.num_experts, expert_ffn_size(cfg)
    f = f"{p}.feed_forward"
    specs.append(ParamSpec(f"{f}.router.weight", (e, h), layer=layer))
    specs.append(ParamSpec(f"{f}.experts.w1", (e, width, h), 1, expert=True, layer=layer))
    specs.append(ParamSpec(f"{f}.experts.w2", (e, h, width), 2, expert=True, layer=layer))
    if not gpt:
        specs.append(ParamSpec(f"{f}.experts.w3", (e, width, h), 1, expert=True, layer=layer))
    if cfg.num_shared_experts:
        specs += _mlp(cfg, f"{f}.shared_experts", cfg.num_shared_experts * width, layer)
    return specs


def embedding_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Token embedding [V, h] (vocabulary-parallel) and the gpt family's position table [max_seq, h]."""
    specs = [ParamSpec("tok_embeddings.weight", (cfg.vocab_size, cfg.hidden_size), 0)]
    if cfg.family == "gpt":
        specs.append(ParamSpec("pos_embeddings.weight", (cfg.max_seq_len, cfg.hidden_size)))
    return specs


def head_specs(cfg: ModelConfig, separate_copy: bool) -> list[ParamSpec]:
    """Final norm and the output head [V, h]; a tied head is its own tensor only when `separate_copy`
    (a pipeline's last stage), otherwise it is the embedding."""
    specs = _norm(cfg, "norm", None)
    if not cfg.tie_embeddings or separate_copy:
        specs.append(ParamSpec("output.weight", (cfg.vocab_size, cfg.hidden_size), 0))
    return specs


def model_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every distinct tensor of the single-process model (a tied head counted once)."""
    specs = embedding_specs(cfg)
    for layer in range(cfg.num_layers):
        specs += layer_specs(cfg, layer)
    return specs + head_specs(cfg, separate_copy=False)


def count_params(cfg: ModelConfig, position_embeddings: bool = True) -> int:
    """Total parameters: sum of numel over model_specs. Transformer.num_params() leaves out the
    position table (position_embeddings=False gives its number)."""
    return sum(s.numel for s in model_specs(cfg) if position_embeddings or not s.name.startswith("pos_"))


_CACHE: dict[tuple, object] = {}  # keyed by repr(ModelConfig) (a mutable dataclass: not hashable)


def stage_layers(cfg: ModelConfig, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Layer ids of each pipeline stage: the trainer's split (suite.parallel.pipeline.split_layers,
    as plan_stages calls it) computed from the counts alone."""
    key = ("stages", repr(cfg), num_stages)
    if key not in _CACHE:
        from suite.parallel.pipeline import split_layers

        costs = [sum(s.numel for s in layer_specs(cfg, i)) for i in range(cfg.num_layers)]
        first = sum(s.numel for s in embedding_specs(cfg))
        last = sum(s.numel for s in head_specs(cfg, separate_copy=True))
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
            specs += head_specs(cfg, separate_copy=True)
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
