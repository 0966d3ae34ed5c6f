"""A decoder-only transformer in one readable file: the shared blocks every model family builds from.

A family (suite/models/<name>/, registered in suite.models.family) picks among them by its traits:
LayerNorm or RMSNorm, learned positions or RoPE, a GELU or SwiGLU MLP, biases, per-head q/k norms.
Grouped-query attention, a head size independent of the width (model.head_dim) and MoE layers
(suite.models.moe) are config fields every family takes.

No parallel code lives here: suite.parallel rewrites these modules from outside. To keep that
possible, shapes are never derived from the config inside forward (heads are `-1` in views), so a
tensor-parallel shard of a projection just works, and `layers` is a ModuleDict so pipeline stages
can drop layers while keeping the names checkpoints use.

`model.fused_projections=true` computes q, k and v with one matmul (`attention.wqkv`) and the
SwiGLU gate and up projections with one (`feed_forward.w13`). The fused rows are laid out so that
any contiguous split into whole kv-head groups (or whole gate/up pairs) is itself a valid smaller
layer, which is what a column-parallel shard is (suite.parallel.tensor_parallel):

    wqkv rows: for each kv head g: [q heads g*r .. g*r+r-1 | k head g | v head g]   (r = heads / kv heads)
    w13 rows:  gate_0, up_0, gate_1, up_1, ...                                       (interleaved pairs)

`fuse_state_dict` / `unfuse_state_dict` convert between the two layouts (HF import/export use the
unfused names). A fused model's seeded init equals the unfused model's (the same values, fused).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import ModelConfig
from suite.models.document_attention import Documents, document_attention
from suite.models.family import family_of, ffn_size, head_size, kv_heads, rotary_size
from suite.models.layers import FeedForward, RMSNorm, make_norm
from suite.models.moe import MoEFeedForward, moe_layer_ids
from suite.models.mtp import MTPModule, mtp_config, mtp_loss

# re-exported: the dimensions and layers callers read from here
__all__ = ["FeedForward", "RMSNorm", "ffn_size", "head_size", "kv_heads", "make_norm"]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style scaling when `rope_scaling.rope_type == llama3`."""
    head_dim = rotary_size(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"model.rope_scaling.rope_type={kind!r} is not supported; use linear or llama3")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face Llama layout). x: [b, s, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


def cache_dims(model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((heads, width) of the keys, (heads, width) of the values) each layer caches: its attention's
    `cache_dims` where it has its own (MLA: the compressed latent and the shared RoPE key), else
    the model's kv heads of head_dim."""
    default = ((model.num_kv_heads, model.head_dim),) * 2
    return [getattr(layer.attention, "cache_dims", default) for layer in model.layers.values()]


@dataclass
class KVCache:
    """Per-layer key/value buffers of a fixed length for incremental decoding (suite generate)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, model: Transformer, batch: int, max_len: int) -> KVCache:
        p = next(model.parameters())
        dims = cache_dims(model)
        # plain tensors even where the parameters are wrapped (a sharded parameter's new_zeros would be
        # sharded too, and the keys computed from the gathered weights are not)
        return cls(
            [torch.zeros((batch, k[0], max_len, k[1]), dtype=p.dtype, device=p.device) for k, _ in dims],
            [torch.zeros((batch, v[0], max_len, v[1]), dtype=p.dtype, device=p.device) for _, v in dims],
        )

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        """Write k, v [b, kv heads, s, d] at `start`; the keys and values of positions 0 .. start + s."""
        if self.keys[layer].device != k.device or self.keys[layer].dtype != k.dtype:
            # stored parameters elsewhere than the compute (offloaded to the host) or in another dtype
            # (fp32 masters, bf16 compute): the buffers follow the keys, once
            self.keys[layer] = self.keys[layer].to(device=k.device, dtype=k.dtype)
            self.values[layer] = self.values[layer].to(device=v.device, dtype=v.dtype)
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, tokens: int) -> None:
        self.length += tokens


@dataclass
class GrowingKVCache:
    """Past keys/values that each call extends by concatenation: the cache of the exported prefill and
    decode graphs (suite.infer.graphs), whose length is a tensor dimension rather than a Python int,
    so one program serves every past length; no in-place writes, which torch.export and ONNX want."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int | torch.SymInt = 0

    def __post_init__(self) -> None:
        self.length = self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
        self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def advance(self, tokens: int) -> None:
        self.length = self.length + tokens


def extend_cache(
    cache: tuple[KVCache | GrowingKVCache, int, int], k: torch.Tensor, v: torch.Tensor, mask: object
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Write this layer's new k, v [b, heads, s, d] (or an attention's own pair) into the cache at the
    chunk's position; (everything cached so far, the mask the chunk attends with). cache: (the
    model's cache, this layer's number, the position of the chunk's first token)."""
    kv_cache, layer, start = cache
    chunk = k.shape[2]
    k, v = kv_cache.extend(layer, k, v, start)
    if chunk > 1 and start > 0:  # a chunk after a prefix: causal within the chunk, all of the prefix
        mask = torch.ones(chunk, start + chunk, dtype=torch.bool, device=k.device).tril(start)
    return k, v, mask


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with the [s, s] scores materialised in q's dtype (causal when
    `mask` is None). What `model.attention=explicit` runs: Megatron's unfused path (scores in bf16, the
    softmax accumulating in fp32), which on CPU in bf16 is twice as fast as torch's flash kernel at these
    lengths, at the cost of keeping the probabilities for the backward. q: [b, heads, s, d]."""
    if k.shape[1] != q.shape[1]:  # grouped-query: each kv head serves heads / kv heads query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s, t = q.shape[2], k.shape[2]
    if mask is None:  # causal, aligned top-left like sdpa's is_causal
        bias = torch.full((s, t), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    else:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + bias
    return torch.softmax(scores, dim=-1) @ v


class CoreAttention(nn.Module):
    """softmax(QK^T)V alone: the unit that `recompute=core_attn` checkpoints.

    mask: None (causal), a boolean [b, 1, q, k] mask, or the packed `Documents` of the batch (each
    document attends on its own, or through their dense mask with model.document_attention=dense).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, explicit: bool = False):
        super().__init__()
        self.gqa = num_kv_heads != num_heads
        self.explicit = explicit  # model.attention=explicit (for training-length queries; decoding: sdpa)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Documents | None = None
    ) -> torch.Tensor:
        if isinstance(mask, Documents):
            if not mask.dense:
                return document_attention(q, k, v, mask, self.attend)
            mask = mask.mask()
        return self.attend(q, k, v, mask)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One attention call: causal when `mask` is None, else the boolean mask."""
        if self.explicit and q.shape[2] > 1:
            return explicit_attention(q, k, v, mask)
        if mask is None:
            causal = bool(q.shape[2] > 1)  # bool(): under torch.export the length is symbolic
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=self.gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """wq/wk/wv weights (or biases), stacked on dim 0, into the fused kv-group layout of `wqkv`.

    Only `narrow` and `torch.cat`, which suite.models.lazy keeps lazy: a rank that imports an HF
    checkpoint into a sharded fused model reads just the rows of its own shard."""
    rq, rkv = q.shape[0] // num_kv_heads, k.shape[0] // num_kv_heads
    parts = []
    for g in range(num_kv_heads):
        parts += [q.narrow(0, g * rq, rq), k.narrow(0, g * rkv, rkv), v.narrow(0, g * rkv, rkv)]
    return torch.cat(parts)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The inverse of fuse_qkv: (wq, wk, wv) weights or biases."""
    per_group = qkv.shape[0] // num_kv_heads  # (r + 2) * head_dim rows
    head_dim = per_group // (num_heads // num_kv_heads + 2)
    rq = per_group - 2 * head_dim
    spans = ((0, rq), (rq, head_dim), (rq + head_dim, head_dim))
    return tuple(
        torch.cat([qkv.narrow(0, g * per_group + start, length) for g in range(num_kv_heads)])
        for start, length in spans
    )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """w1 (gate) and w3 (up) weights into the interleaved rows of `w13`."""
    return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:])


def split_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = w13.reshape(-1, 2, *w13.shape[1:])
    return pairs[:, 0], pairs[:, 1]


_FUSED = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}


def unfuse_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fused model's state dict under the unfused names (wq/wk/wv, w1/w3); others untouched."""
    out: dict[str, torch.Tensor] = {}
    for name, value in sd.items():
        prefix, _, rest = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        if module == "wqkv":
            parts = split_qkv(value, cfg.num_heads, kv_heads(cfg))
        elif module == "w13":
            parts = split_gate_up(value)
        else:
            out[name] = value
            continue
        for part, tensor in zip(_FUSED[module], parts):
            out[f"{module_prefix}.{part}.{rest}"] = tensor.contiguous()
    return out


def fuse_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An unfused state dict under a fused model's names (wqkv, w13): the inverse of unfuse_state_dict."""
    out = dict(sd)
    for name in list(sd):
        prefix, _, rest = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        if module == "wq" and f"{module_prefix}.wk.{rest}" in sd:
            q, k, v = (out.pop(f"{module_prefix}.{m}.{rest}") for m in ("wq", "wk", "wv"))
            out[f"{module_prefix}.wqkv.{rest}"] = fuse_qkv(q, k, v, kv_heads(cfg))
        elif module == "w1" and f"{module_prefix}.w3.{rest}" in sd:
            gate, up = out.pop(name), out.pop(f"{module_prefix}.w3.{rest}")
            out[f"{module_prefix}.w13.{rest}"] = fuse_gate_up(gate, up)
    return out


class Attention(nn.Module):
    @staticmethod
    def score_widths(cfg: ModelConfig) -> tuple[int, int]:
        """(q . k width, value width), over all heads: what QK^T and PV multiply per key."""
        return cfg.num_heads * head_size(cfg), cfg.num_heads * head_size(cfg)

    @staticmethod
    def saved_widths(cfg: ModelConfig) -> tuple[int, int]:
        """(split, whole): elements per token the attention keeps for its backward beyond its input
        and the scores, split over tp ranks by heads (Q, K, V and the output) and whole on every tp
        rank (none here); the planner's activation count (suite.plan.activations) reads it."""
        q_w, kv_w = cfg.num_heads * head_size(cfg), kv_heads(cfg) * head_size(cfg)
        return 2 * q_w + 2 * kv_w, 0

    @staticmethod
    def tp_roles(cfg: ModelConfig) -> dict[str, str]:
        """How tensor parallelism splits it (suite.parallel.tensor_parallel.block_plan): q, k, v by
        heads (whole kv groups when fused), wo by its input, a family's q/k norms per head."""
        qkv = ["wqkv"] if cfg.fused_projections else ["wq", "wk", "wv"]
        roles = dict.fromkeys(qkv, "colwise")
        if family_of(cfg).qk_norm:  # over each head's width: whole on every rank, whatever heads it holds
            roles |= {"q_norm": "headwise", "k_norm": "headwise"}
        return roles | {"wo": "rowwise"}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = head_size(cfg)
        family = family_of(cfg)
        qkv_bias = family.linear_bias or cfg.qkv_bias
        n_kv = kv_heads(cfg)
        self.q_per_kv = cfg.num_heads // n_kv
        if cfg.fused_projections:
            fused_out = (cfg.num_heads + 2 * n_kv) * self.head_dim
            self.wqkv = nn.Linear(cfg.hidden_size, fused_out, bias=qkv_bias)
        else:
            self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=qkv_bias)
            self.wk = nn.Linear(cfg.hidden_size, n_kv * self.head_dim, bias=qkv_bias)
            self.wv = nn.Linear(cfg.hidden_size, n_kv * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=family.linear_bias)
        if family.qk_norm:  # one RMSNorm over each head's width, shared by the heads (Qwen3)
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.core = CoreAttention(cfg.num_heads, n_kv, explicit=cfg.attention == "explicit")

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | Documents | None = None,
        cache: tuple[KVCache | GrowingKVCache, int, int] | None = None,
    ) -> torch.Tensor:
        """cache: (the model's cache, this layer's number, the position of x's first token)."""
        b, s, _ = x.shape
        if hasattr(self, "wqkv"):  # [b, s, kv groups (local under tp), r + 2, head_dim]
            qkv = self.wqkv(x).view(b, s, -1, self.q_per_kv + 2, self.head_dim)
            q = qkv[:, :, :, : self.q_per_kv].reshape(b, s, -1, self.head_dim)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            q = self.wq(x).view(b, s, -1, self.head_dim)
            k = self.wk(x).view(b, s, -1, self.head_dim)
            v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v, mask = extend_cache(cache, k, v, mask)
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(cfg)
        self.attention = (family_of(cfg).attention or Attention)(cfg)
        self.ffn_norm = make_norm(cfg)
        if layer_id in moe_layer_ids(cfg):
            self.feed_forward = MoEFeedForward(cfg)
        else:
            self.feed_forward = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None, mask=None, cache=None):
        x = x + self.dropout(self.attention(self.attention_norm(x), rope, mask, cache))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        family = family_of(cfg)
        self.cfg = cfg
        self.head_dim = head_size(cfg)
        self.num_kv_heads = kv_heads(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = None if family.rope else nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.mtp = None  # multi-token prediction modules (suite.models.mtp), training only
        self.mtp_loss: torch.Tensor | None = None
        if cfg.num_mtp_layers:
            dense = mtp_config(cfg)
            self.mtp = nn.ModuleDict(
                {
                    str(k): MTPModule(cfg, cfg.num_layers + k, TransformerBlock(dense, cfg.num_layers + k))
                    for k in range(cfg.num_mtp_layers)
                }
            )
        if family.rope:
            self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)
        else:
            self.rope_inv_freq = None

    def tie_weights(self) -> None:
        """Share the embedding with the output head (again after to_empty, which unties them)."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    # ---- positions -------------------------------------------------------------------------
    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions, shaped to broadcast over [b, s, heads, head_dim]."""
        freqs = positions.float()[..., None] * self.rope_inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if cos.dim() == 2:  # [s, d] -> [1, s, 1, d]
            return cos[None, :, None, :], sin[None, :, None, :]
        return cos[:, :, None, :], sin[:, :, None, :]  # [b, s, d] -> [b, s, 1, d]

    def forward(
        self,
        tokens: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | GrowingKVCache | None = None,
        hidden: torch.Tensor | None = None,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        doc_ids: torch.Tensor | None = None,
        mtp_targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for `tokens` [b, s]. Pipeline stages after the first pass `hidden` instead.

        positions: [s] or [b, s] absolute positions (default: arange from the cache length);
        mask: an optional boolean attention mask (True = attend);
        doc_ids: [b, S] document number of each position of packed rows (suite.data.documents; under
        context parallelism the whole sequence's): attention stays inside documents, per document or
        through a dense mask as `model.document_attention` says (suite.models.document_attention).
        head: called as head(final hidden states, output weight) in place of the output projection, and
        its result returned: a loss that applies the head itself (chunked cross-entropy) runs inside
        this forward, where wrappers that gather parameters around forward (FSDP) have the weight whole.
        mtp_targets: multi-token prediction's targets of these positions (suite.models.mtp.mtp_targets;
        default: from `tokens`, whole rows); context parallelism passes its chunks', and the last
        pipeline stage (given `hidden`, not `tokens`) its micro-batch's.
        """
        start = kv_cache.length if kv_cache is not None else 0
        if hidden is None:
            seq = tokens.shape[1]
            if positions is None:
                positions = torch.arange(start, start + seq, device=tokens.device)
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
            h = self.dropout(h)
        else:
            h = hidden
            if positions is None:
                positions = torch.arange(start, start + h.shape[1], device=h.device)
        rope = self.rope_tables(positions, h.dtype) if self.rope_inv_freq is not None else None
        if doc_ids is not None:
            if mask is not None:
                raise ValueError("pass either mask or doc_ids, not both")
            mask = Documents(doc_ids, dense=self.cfg.document_attention == "dense")
        for i, layer in enumerate(self.layers.values()):
            cache = (kv_cache, i, start) if kv_cache is not None else None
            h = layer(h, rope, mask, cache)
        if kv_cache is not None:
            kv_cache.advance(h.shape[1])
        later = tokens is not None or mtp_targets is not None  # the tokens MTP embeds and predicts
        if self.mtp is not None and self.training and later and kv_cache is None:
            self.mtp_loss = mtp_loss(self, tokens, h, rope, mtp_targets) * self.cfg.mtp_loss_coef
        if self.norm is not None:
            h = self.norm(h)
        if head is not None and self.output is not None:
            return head(h, self.output.weight)
        return self.output(h) if self.output is not None else h

    # ---- init and accounting ----------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded GPT-2/Megatron init: N(0, std), residual projections scaled by 1/sqrt(2L).

        Values depend only on (seed, parameter name), so every parallel layout starts identical.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)

        def initial(name: str, shape: torch.Size) -> torch.Tensor:
            if name.endswith("bias"):
                return torch.zeros(shape)
            if "norm" in name:
                return torch.ones(shape)
            scale = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            # One generator per parameter name: the same values whatever layers this rank holds.
            gen = torch.Generator(device="cpu").manual_seed(seed + zlib.crc32(name.encode()))
            return torch.randn(shape, generator=gen) * scale

        for name, param in self.named_parameters():
            if ".wqkv." in name or ".w13." in name:  # the unfused parts' values, fused: same model
                parts = unfuse_state_dict(self.cfg, {name: torch.empty(param.shape)})
                fused = fuse_state_dict(self.cfg, {n: initial(n, t.shape) for n, t in parts.items()})
                init = fused[name]
            else:
                init = initial(name, param.shape)
            param.copy_(init.to(param.dtype))
        Transformer.init_buffers(self)  # on the class: full_init (suite.parallel) passes a stand-in

    def init_buffers(self) -> None:
        """The derived (non-persistent) buffers: the RoPE frequencies."""
        if self.rope_inv_freq is not None:
            self.rope_inv_freq.copy_(rope_inv_freq(self.cfg).to(self.rope_inv_freq.device))

    def num_params(self, exclude_position_embeddings: bool = True) -> int:
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_position_embeddings and name.startswith("pos_embeddings")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total


def num_params(cfg: ModelConfig) -> int:
    """Parameter count from the config alone (no weights are allocated)."""
    with torch.device("meta"):
        return Transformer(cfg).num_params()


@dataclass(frozen=True)
class LayerMatmuls:
    """What one layer multiplies per token, read off the block the trainer builds (any family):
    `attention` weights (the projections), the widths the scores and the values have over all heads
    (QK^T costs 2 x keys x `score_width`, PV 2 x keys x `value_width`), and `mlp` weights a token
    goes through (MoE: the router, its top-k experts and the shared experts)."""

    attention: int
    score_width: int
    value_width: int
    mlp: int


_MATMULS: dict[tuple, LayerMatmuls] = {}


def layer_matmuls(cfg: ModelConfig, layer: int) -> LayerMatmuls:
    moe = layer in moe_layer_ids(cfg)
    key = (repr(cfg), moe)
    if key not in _MATMULS:
        with torch.device("meta"):
            block = TransformerBlock(cfg, layer)
        attention = sum(p.numel() for p in block.attention.parameters() if p.dim() == 2)
        score_width, value_width = block.attention.score_widths(cfg)
        ff = block.feed_forward
        if moe:
            per_expert = sum(p[0].numel() for p in ff.experts.parameters() if p.dim() == 3)
            shared = (
                sum(p.numel() for p in ff.shared_experts.parameters() if p.dim() == 2)
                if ff.shared_experts
                else 0
            )
            mlp = ff.router.weight.numel() + min(cfg.top_k, cfg.num_experts) * per_expert + shared
        else:
            mlp = sum(p.numel() for p in ff.parameters() if p.dim() == 2)
        _MATMULS[key] = LayerMatmuls(attention, score_width, value_width, mlp)
    return _MATMULS[key]


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training matmul FLOPs per token, the MFU numerator: 3 x the forward (backward = 2 forwards).

    Only matrix products count, so MFU compares like with like against a matmul ceiling: the
    attention's projections, the MLP (MoE: the router and the top-k experts a token goes to, plus
    shared experts), the output head (tied or not: its matmul is real work), and the attention
    products QK^T and PV over a causal mask, which see seq_len / 2 keys on average (`layer_matmuls`).
    Embedding lookups (token and position), norms, biases and activations are not matmuls.
    """
    forward = 2.0 * cfg.hidden_size * cfg.vocab_size  # output head
    for layer in range(cfg.num_layers):
        m = layer_matmuls(cfg, layer)
        forward += 2 * m.attention + 2 * (seq_len / 2) * (m.score_width + m.value_width) + 2 * m.mlp
    return 3.0 * forward


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Transformer:
    """Build on `device` (meta by default: no memory, parallelize first, materialise later)."""
    with torch.device(device):
        return Transformer(cfg)


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """State that is no parameter starts at its initial value (to_empty leaves it uninitialised):
    every module with a `reset_buffers` method (the MoE router's balancing bias) resets it."""
    for module in model.modules():
        if hasattr(module, "reset_buffers") and module is not model:
            module.reset_buffers()


def materialize(model: Transformer, device: str | torch.device, seed: int | None) -> Transformer:
    """Allocate a meta-built model on `device` and run the seeded init; seed None leaves the
    parameters to a caller that overwrites every one (a model read from a file) and sets the buffers."""
    model.to_empty(device=device)
    model.tie_weights()
    model.init_buffers() if seed is None else model.init_weights(seed)
    reset_buffers(model)
    return model
