"""FLOPs of one training step, with recompute.

Counting convention (Narayanan et al. 2021, Appendix; the PaLM MFU convention too): matmul FLOPs
only, 2 per multiply-add, attention over the full s x s score matrix. A forward pass of one
sequence of s tokens through a GPT layer is 24 s h^2 + 4 s^2 h; backward is twice the forward;
full recompute runs the layers' forward once more (not the head). For GPT with f = 4h this gives
the paper's step total

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))          (with full recompute)
    F = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))          (without)

`narayanan_flops` is that formula; `layer_forward_flops` / `step_flops` are the same counting for
any suite model (grouped-query attention, SwiGLU, MoE's routed top-k experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from suite.config.schema import ModelConfig
from suite.models.transformer import layer_matmuls


def narayanan_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True
) -> float:
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) per step with full recompute;
    72 B s l h^2 (1 + s/6h + V/12lh) without (3 passes instead of 4 over the layers)."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer for one sequence of s tokens, by part."""

    projections: float  # q, k, v, o
    core: float  # QK^T and PV
    mlp: float  # MLP, or router + top-k (+ shared) experts

    @property
    def total(self) -> float:
        return self.projections + self.core + self.mlp


def layer_forward_flops(cfg: ModelConfig, seq: int, layer: int) -> LayerFlops:
    """2 s x the attention's weights for the projections, 2 s^2 x (score + value width) for QK^T and
    PV (full matrix), 2 s x the MLP weights a token goes through (MoE: router, top_k + shared experts),
    read off the block the trainer builds (suite.models.transformer.layer_matmuls: any family, MLA too)."""
    m = layer_matmuls(cfg, layer)
    return LayerFlops(2 * seq * m.attention, 2 * seq * seq * (m.score_width + m.value_width), 2 * seq * m.mlp)


_TABLES: dict[tuple, tuple[LayerFlops, ...]] = {}


def layer_table(cfg: ModelConfig, seq: int) -> tuple[LayerFlops, ...]:
    """layer_forward_flops of every layer, computed once per (model, sequence length)."""
    key = (repr(cfg), seq)
    if key not in _TABLES:
        _TABLES[key] = tuple(layer_forward_flops(cfg, seq, i) for i in range(cfg.num_layers))
    return _TABLES[key]


def head_forward_flops(cfg: ModelConfig, seq: int) -> float:
    """The output projection: 2 s h V."""
    return 2.0 * seq * cfg.hidden_size * cfg.vocab_size


def recompute_flops(f: LayerFlops, granularity: str) -> float:
    """Forward FLOPs of a layer (`f`) run again in backward: full (the block), full_attn
    (projections + core), core_attn (QK^T and PV only), none."""
    if granularity == "full":
        return f.total
    if granularity == "full_attn":
        return f.projections + f.core
    return f.core if granularity == "core_attn" else 0.0


def step_flops(cfg: ModelConfig, seq: int, sequences: int, granularity: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of a step over `sequences`: model = 3 x forward (the MFU
    numerator); hardware adds the recomputed forward (Narayanan's achieved-TFLOP/s numerator)."""
    forward = head_forward_flops(cfg, seq)
    extra = 0.0
    for f in layer_table(cfg, seq):
        forward += f.total
        extra += recompute_flops(f, granularity)
    model = 3 * forward * sequences
    return model, model + extra * sequences
