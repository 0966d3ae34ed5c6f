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

Every depth runs over the whole sequence: position i's input token i + k and target i + k + 1 are
read from `mtp_targets` ([b, D + 1, s]: the tokens at i + 1 .. i + D + 1, IGNORE_INDEX past the
row's end), and the positions past the end are left out of the loss. Causal attention makes this
equal to cutting the row to its valid positions, and keeps every depth's activations the shape of
the main model's, so the layouts that split the sequence place them alike: context parallelism
hands each rank its chunks' `mtp_targets` (taken from the whole row before the split) and sets
each module's `count_tokens` to the whole row's count (suite.parallel.context_parallel); tensor
parallelism plans the modules like the blocks around them (suite.parallel.tensor_parallel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import ModelConfig
from suite.data.batch import IGNORE_INDEX
from suite.models.layers import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, block: nn.Module):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.projection = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block  # a dense block of the model's family (layer id past the model's layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # the number of target positions the loss divides by, from this rank's (a parallel layout
        # that splits the sequence sets it: suite.parallel.context_parallel)
        self.count_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope) -> torch.Tensor:
        x = self.projection(torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1))
        return self.block(x, rope)


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The config the MTP blocks are built with: dense (no MoE layer among them)."""
    return dataclasses.replace(cfg, num_experts=0, moe_layers=None)


def mtp_targets(tokens: torch.Tensor, depths: int) -> torch.Tensor:
    """[b, depths + 1, s]: for each position i the tokens at i + 1 .. i + depths + 1 of the row
    (IGNORE_INDEX past its end): depth k embeds row k - 1 and predicts row k."""
    b, seq = tokens.shape
    out = tokens.new_full((b, depths + 1, seq), IGNORE_INDEX)
    for j in range(depths + 1):
        out[:, j, : max(seq - j - 1, 0)] = tokens[:, j + 1 :]
    return out


def mtp_loss(
    model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor, rope, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean over depths of each depth's mean cross-entropy; hidden: the last layer's output
    [b, s, h] (before the final norm); rope: the main model's RoPE tables (or None); targets:
    `mtp_targets` of this rank's positions (default: from `tokens`, the whole rows)."""
    depths = list(model.mtp.values())
    if targets is None:
        targets = mtp_targets(tokens, len(depths))
    total = hidden.new_zeros((), dtype=torch.float32)
    for k, module in enumerate(depths, start=1):
        embedded = model.tok_embeddings(targets[:, k - 1].clamp(min=0))
        hidden = module(hidden, embedded, rope)
        logits = model.output(module.norm(hidden)).float()
        target = targets[:, k]
        count = (target != IGNORE_INDEX).sum().float()
        if module.count_tokens is not None:
            count = module.count_tokens(count)
        loss = F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total = total + loss / count.clamp(min=1.0)
    return total / len(depths)
