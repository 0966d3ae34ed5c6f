"""The layers every model family shares: norms and the dense MLP (SwiGLU or GELU).

Attention, RoPE and the blocks are in suite.models.transformer; the MoE layer (suite.models.moe) uses
FeedForward for its shared experts, which is why these live below both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import ModelConfig
from suite.models.family import family_of, ffn_size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width = ffn_size(cfg)
        self.swiglu = family_of(cfg).swiglu
        bias = family_of(cfg).linear_bias
        if self.swiglu and cfg.fused_projections:
            self.w13 = nn.Linear(cfg.hidden_size, 2 * width, bias=False)  # (gate, up) row pairs
        else:
            self.w1 = nn.Linear(cfg.hidden_size, width, bias=bias)  # gate (llama) / fc (gpt)
            self.w3 = nn.Linear(cfg.hidden_size, width, bias=False) if self.swiglu else None  # up
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=bias)  # down / proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate_up = self.w13(x).unflatten(-1, (-1, 2))
            return self.w2(F.silu(gate_up[..., 0]) * gate_up[..., 1])
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    if family_of(cfg).rms_norm:
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
