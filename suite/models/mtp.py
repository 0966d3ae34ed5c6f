"""Multi-token prediction (DeepSeek-V3, sec. 2.2): D sequential modules after the last layer; module
k combines the previous depth's hidden state at position i with the embedding of token i + k,

    h'_k = W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))],  h_k = Block_k(h'_k),  P_k = Head(Norm_k(h_k)),

and its cross-entropy against t_{i+k+1} (the positions whose target lies in the micro-batch's own
tokens) is averaged over the depths and weighted by model.mtp_loss_coef into the training loss (the
way MoE's auxiliary losses are: suite.train.step.training_loss). The embedding and the output head
are the model's own (shared, as in DeepSeek-V3). The modules only train: evaluation, generation and
every export use the main model alone (HF checkpoints hold no MTP layers: transformers ignores them).

Packed documents: the modules attend causally over the whole row (no document mask), an
approximation at the document seams.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import ModelConfig
from suite.models.layers import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, block: nn.Module):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.projection = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block  # a dense block of the model's family (layer id past the model's layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope) -> torch.Tensor:
        x = self.projection(torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1))
        return self.block(x, rope)


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The config the MTP blocks are built with: dense (no MoE layer among them)."""
    return dataclasses.replace(cfg, num_experts=0, moe_layers=None)


def mtp_loss(model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor, rope_for) -> torch.Tensor:
    """The mean over depths of each depth's mean cross-entropy; hidden: the last layer's output
    [b, s, h] (before the final norm); rope_for(n): the RoPE tables of positions 0 .. n-1 (or None)."""
    depths = list(model.mtp.values())
    seq = tokens.shape[1]
    total = hidden.new_zeros(())
    for k, module in enumerate(depths, start=1):
        if seq - k < 2:
            break
        embedded = model.tok_embeddings(tokens[:, k:])
        hidden = module(hidden[:, : seq - k], embedded, rope_for(seq - k))
        logits = model.output(module.norm(hidden[:, :-1])).float()
        total = total + F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 :].flatten())
    return total / len(depths)
