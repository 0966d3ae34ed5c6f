"""Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank bottleneck, keys and
values expanded per head from one compressed latent, plus one RoPE key shared by every head.

    q = wq_b(norm(wq_a(x)))             [b, s, heads, nope + rope]    (or wq(x) without q_lora_rank)
    latent, k_rope = wkv_a(x)           [b, s, kv_lora_rank], [b, s, rope]
    k_nope, v = wkv_b(norm(latent))     [b, s, heads, nope], [b, s, heads, v_head_dim]
    k = [k_nope | k_rope (every head)], softmax(q k^T / sqrt(nope + rope)) v -> wo

RoPE rotates only the last qk_rope_head_dim dims of q and of the shared key, in DeepSeek's
interleaved pairs (x0, x1), (x2, x3), ... written out in rotate-half order, exactly as transformers'
DeepseekV3Attention (rope_interleave=true) does, so HF checkpoints load unpermuted. The decode cache
holds the normalised latent and the rotated shared key, kv_lora_rank + rope values per token
(`cache_dims`), not the expanded keys and values: what makes MLA's cache small.
"""

from __future__ import annotations

import torch
from torch import nn

from suite.config.schema import ModelConfig
from suite.models.document_attention import Documents
from suite.models.layers import RMSNorm
from suite.models.transformer import CoreAttention, GrowingKVCache, KVCache, extend_cache

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm keep their own eps


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs, the result in rotate-half order. cos/sin: [.., rope] as cat(f, f)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class SharedKey(nn.Module):
    """The RoPE key all heads share, repeated for the heads the caller holds: a module of its own so
    that tensor parallelism (which splits the heads) can sum its gradient over the ranks holding the
    other heads (suite.parallel.tensor_parallel's "shared" role)."""

    def forward(self, k_rope: torch.Tensor, heads: int) -> torch.Tensor:
        return k_rope.expand(-1, heads, -1, -1)


class LatentAttention(nn.Module):
    @staticmethod
    def score_widths(cfg: ModelConfig) -> tuple[int, int]:
        """(q . k width, value width) over all heads: nope + rope per head for the scores, v_head_dim for PV."""
        return cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.num_heads * cfg.v_head_dim

    @staticmethod
    def saved_widths(cfg: ModelConfig) -> tuple[int, int]:
        """(split, whole) elements per token kept for the backward (suite.plan.activations). Split
        over tp by heads: q and k (nope + rope per head), v and the output (v_head_dim per head). Whole
        on every tp rank, the low-rank paths: each latent norm's input, normalised value and output
        (3 x q_lora_rank; for the key-value path wkv_a's output, the latent and the rope key together,
        then 2 x kv_lora_rank). Measured on deepseek-tiny: this plus RoPE's tables and the norms'
        per-token scales (1.9%) is every saved byte (tests/unit/test_plan_model.py)."""
        heads, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        query = 3 * cfg.q_lora_rank if cfg.q_lora_rank else 0
        return (
            2 * heads * qk + 2 * heads * cfg.v_head_dim,
            query + cfg.kv_lora_rank + cfg.qk_rope_head_dim + 2 * cfg.kv_lora_rank,
        )

    @staticmethod
    def tp_roles(cfg: ModelConfig) -> dict[str, str]:
        """How tensor parallelism splits it: by heads (the up-projections, wo by its input), the
        low-rank down-projections and their norms whole on every rank, the shared key summed."""
        query = (
            {"wq_a": "replicate", "q_a_norm": "replicate", "wq_b": "colwise"}
            if cfg.q_lora_rank
            else {"wq": "colwise"}
        )
        return query | {
            "wkv_a": "replicate",
            "kv_a_norm": "replicate",
            "wkv_b": "colwise",
            "shared_key": "shared",
            "wo": "rowwise",
        }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(h, heads * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, h, bias=False)
        self.shared_key = SharedKey()
        self.core = CoreAttention(heads, heads, explicit=cfg.attention == "explicit")
        self.cache_dims = ((1, self.kv_rank), (1, self.rope))  # KVCache: latent, shared RoPE key

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | Documents | None = None,
        cache: tuple[KVCache | GrowingKVCache, int, int] | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rope = k_rope.view(b, s, 1, self.rope)
        q_rope, k_rope = apply_interleaved_rope(q_rope, *rope), apply_interleaved_rope(k_rope, *rope)
        latent, k_rope = latent.view(b, 1, s, self.kv_rank), k_rope.transpose(1, 2)  # [b, 1, s, .]
        if cache is not None:
            latent, k_rope, mask = extend_cache(cache, latent, k_rope, mask)
        t = latent.shape[2]
        kv = self.wkv_b(latent.squeeze(1)).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, self.shared_key(k_rope, k_nope.shape[1])], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
