"""Activation bytes per rank (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4), generalised to grouped-query attention, SwiGLU and MoE.

Per layer and micro-batch, with s tokens (s/cp under context parallelism), b sequences, hidden h,
a heads, tensor-parallel degree t, e bytes per activation element (2 in bf16/fp16, 4 in fp32):

    norm inputs                 2 e s b h            (/t with sequence parallelism)
    q/k/v input, MLP input      2 e s b h            (kept whole: see below)
    Q, K, V, attention output   e s b (2 q_w + 2 kv_w) / t   (the attention's `saved_widths`: MLA's
                                heads' q, k, v and output / t, plus its low-rank latents and their
                                norms whole on every tp rank)
    attention scores            explicit attention: e a s^2 b / t (+ dropout: e a s^2 b/t and a mask)
                                sdpa (flash): 4 a s b / t (the fp32 log-sum-exp), no s^2 term
    MLP                         GELU: 2 e s b f / t;  SwiGLU: 4 e s b f / t (gate, silu, up, product)
    dropout masks               2 s b h bytes when model.dropout > 0

For GPT (q_w = kv_w = h, f = 4h, dropout, explicit attention, e = 2) this is the paper's
s b h (34 + 5 a s / h) with t = 1. One difference from Megatron: PyTorch's DTensor sequence
parallelism keeps the all-gathered input of a column-parallel linear for its backward, so the two
linear inputs stay 2 e s b h each under sp (Megatron re-gathers them and stores 1/t).

Recompute (suite.parallel.recompute): full keeps only each block's input (e s b h, /t with sp);
core_attn ("selective") drops the scores term; full_attn keeps the attention norm's input and the
MLP's activations. A recomputed block's full activations exist once, transiently, in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from suite.models.family import family_of
from suite.models.moe import expert_ffn_size
from suite.models.transformer import Attention, ffn_size
from suite.plan.layout import Job, Layout


@dataclass(frozen=True)
class LayerActivations:
    """Bytes of one layer for one micro-batch on one rank, by part."""

    norms: float
    linear_inputs: float
    attention: float  # Q, K, V, attention output
    scores: float
    mlp: float
    masks: float

    @property
    def total(self) -> float:
        return self.norms + self.linear_inputs + self.attention + self.scores + self.mlp + self.masks


def layer_activations(job: Job, layout: Layout, moe: bool = False) -> LayerActivations:
    """One layer's saved activations without recompute (the formula in the module docstring)."""
    m = job.model
    e, t = job.compute_bytes, layout.tp
    s, b, h = job.seq_len / layout.cp, layout.micro_batch, m.hidden_size
    sbh = s * b * h
    split, whole = (family_of(m).attention or Attention).saved_widths(m)
    sp_div = t if layout.sp else 1
    norms = 2 * e * sbh / sp_div
    linear_inputs = 2 * e * sbh
    attention = e * s * b * (split / t + whole)
    keys = job.seq_len  # every query attends over the whole sequence (cp: held a chunk at a time)
    if m.attention == "explicit":
        scores = e * m.num_heads * s * keys * b / t * (2 if m.dropout > 0 else 1)
        scores += m.num_heads * s * keys * b / t if m.dropout > 0 else 0
    else:
        scores = 4 * m.num_heads * s * b / t
    per_width = 4 if family_of(m).swiglu else 2
    if moe:
        width = expert_ffn_size(m) * (m.top_k + m.num_shared_experts)
        # expert hidden activations (split on ffn by tp), the routed copies of the tokens in and out
        # of the experts and the fp32 router logits (replicated on every tp rank)
        mlp = per_width * e * s * b * width / t + 2 * e * m.top_k * sbh + 2 * 4 * s * b * m.num_experts
    else:
        mlp = per_width * e * s * b * ffn_size(m) / t
    masks = 2 * sbh / sp_div if m.dropout > 0 else 0.0
    return LayerActivations(norms, linear_inputs, attention, scores, mlp, masks)


def kept_per_layer(job: Job, layout: Layout, moe: bool = False) -> float:
    """Bytes one layer keeps for one micro-batch until its backward, under layout.recompute."""
    full = layer_activations(job, layout, moe)
    sp_div = layout.tp if layout.sp else 1
    block_input = job.compute_bytes * job.seq_len / layout.cp * layout.micro_batch * job.model.hidden_size
    if layout.recompute == "full":
        return block_input / sp_div
    if layout.recompute == "core_attn":
        return full.total - full.scores
    if layout.recompute == "full_attn":
        # the attention norm's input (the block input) stays; q/k/v input, Q/K/V/output, scores go
        return full.total - full.linear_inputs / 2 - full.attention - full.scores
    return full.total


def in_flight(layout: Layout, micro_batches: int, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at once, in units of its own
    layers: 1 without pp; m for GPipe; min(p - r, m) for 1F1B (Narayanan et al. 2021, 2.2.1: the
    first stage holds p); p - r + (p - 1)/v for the interleaved schedule (Korthikanti et al. 2022,
    4.2.3: the first stage's memory grows by 1 + (p - 1)/(p v)); zero-bubble taken as interleaved
    (its W passes keep inputs a little longer: an underestimate)."""
    p, v, m = layout.pp, layout.vpp, micro_batches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(p - rank, m))
    return min(p - rank + (p - 1) / v, float(m))


@dataclass(frozen=True)
class RankActivations:
    layers: float  # kept activations of the rank's layers, all micro-batches in flight
    transient: float  # one recomputed layer's full activations, the head's logits chunk
    embedding: float  # the first stage's embedding output, per micro-batch in flight

    @property
    def total(self) -> float:
        return self.layers + self.transient + self.embedding


def rank_activations(
    job: Job, layout: Layout, layers_on_rank: int, moe_layers_on_rank: int = 0, pp_rank: int = 0
) -> RankActivations:
    """Peak activation bytes of pipeline rank `pp_rank`: kept_per_layer x its layers x in_flight,
    plus the working set of one recomputed layer and of the head (head_bytes)."""
    m = job.model
    dense = layers_on_rank - moe_layers_on_rank
    flight = in_flight(layout, layout.micro_batches(job.global_batch), pp_rank)
    kept = dense * kept_per_layer(job, layout) + moe_layers_on_rank * kept_per_layer(job, layout, moe=True)
    transient = 0.0
    if layout.recompute != "none":
        transient = layer_activations(job, layout, moe=moe_layers_on_rank > 0).total
    tokens = job.seq_len / layout.cp * layout.micro_batch
    transient += head_bytes(job, layout, tokens)
    sp_div = layout.tp if layout.sp else 1
    embedding = job.compute_bytes * tokens * m.hidden_size / sp_div * flight
    return RankActivations(kept * flight, transient, embedding)


def head_bytes(job: Job, layout: Layout, tokens: float) -> float:
    """The output head and loss's working set at its peak, for one micro-batch of `tokens` tokens
    (suite.train.step.TrainStep.model_loss and suite.train.loss, measured: bench/plan_cpu.py).

    Plain loss (tokens <= train.loss_chunk_tokens, chunking off, pp > 1, or tp's loss_parallel):
    F.cross_entropy's log-softmax output, saved for backward, its gradient and the logits' gradient
    exist at once, 3 x 4 bytes per logit (fp32), the vocabulary split over tp. Chunked: one chunk's
    fp32 logits (and their gradient in a compute dtype below fp32) beside the fp32 head-weight
    gradient accumulated over the chunks and d(hidden), both saved to backward, where scaled copies
    of the two are made."""
    m, c = job.model, job.compute_bytes
    chunk = job.loss_chunk_tokens
    if not chunk or tokens <= chunk or layout.pp > 1 or layout.tp > 1:
        return 3 * 4 * tokens * m.vocab_size / layout.tp
    weight_grad = 4 * m.vocab_size * m.hidden_size
    hidden_grad = c * tokens * m.hidden_size
    logits = (4 + (c if c < 4 else 0)) * chunk * m.vocab_size
    backward = 2 * weight_grad + (c * m.vocab_size * m.hidden_size if c < 4 else 0) + 2 * hidden_grad
    return max(logits + weight_grad + hidden_grad, backward)
