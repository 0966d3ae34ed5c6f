"""Activation importance for `suite prune`, measured on calibration batches as in Minitron
(Muralidharan et al., 2024, "Compact Language Models via Pruning and Knowledge Distillation").

Every width is scored the same way: an activation's magnitude |x| averaged over the sequence, then the
L2 norm over the calibration samples (all batches together), per channel.

    MLP channels   the input of each block's down projection (w2)
    heads          the input of each block's attention output projection (wo): the per-channel scores
                   of one head's head_dim channels, L2 norm -> one score per (layer, query head)
    hidden         the outputs of every norm (each block's attention_norm and ffn_norm, the final norm),
                   per channel, accumulated over all of them: what the next matmuls read of each channel
    layers         1 - cosine similarity between a block's input and output, averaged over tokens: a
                   block that barely changes its input matters least
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from suite.config.errors import ConfigError


@dataclass
class Importance:
    channels: list[torch.Tensor]  # per layer: [ffn] MLP channel scores
    heads: list[torch.Tensor]  # per layer: [num_heads] query-head scores
    hidden: torch.Tensor  # [hidden_size] embedding-channel scores
    layers: torch.Tensor  # [num_layers] block scores (1 - cos(input, output))


def _magnitude_sq(x: torch.Tensor) -> torch.Tensor:
    """[b, s, width] -> [width]: mean |x| over the sequence, squared and summed over the batch (the
    square of the L2 norm over samples, to be summed over batches and rooted at the end)."""
    per_sample = x.float().abs().mean(dim=1)
    return (per_sample**2).sum(dim=0)


@torch.no_grad()
def importance(model: nn.Module, batches: list) -> Importance:
    """The scores of every prunable width of `model` on `batches` (suite.data.batch.Batch)."""
    blocks = list(model.layers.values())
    sums: dict[tuple[str, int], torch.Tensor] = {}
    change = torch.zeros(len(blocks), dtype=torch.float64)
    tokens = 0
    hooks = []

    def add(key: tuple[str, int], value: torch.Tensor) -> None:
        sums[key] = value if key not in sums else sums[key] + value

    def on_input(key):
        def hook(module, args):
            add(key, _magnitude_sq(args[0]))

        return hook

    def on_norm(module, args, output):
        add(("hidden", 0), _magnitude_sq(output))

    def on_block(i):
        def hook(module, args, output):
            x, y = args[0].float().flatten(0, 1), output.float().flatten(0, 1)
            change[i] += (1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).double().sum()

        return hook

    for i, block in enumerate(blocks):
        ff = block.feed_forward
        if not hasattr(ff, "w2"):
            raise ConfigError("prune: the source has Mixture-of-Experts layers; pruning needs a dense model")
        hooks.append(ff.w2.register_forward_pre_hook(on_input(("ffn", i))))
        hooks.append(block.attention.wo.register_forward_pre_hook(on_input(("heads", i))))
        hooks.append(block.attention_norm.register_forward_hook(on_norm))
        hooks.append(block.ffn_norm.register_forward_hook(on_norm))
        hooks.append(block.register_forward_hook(on_block(i)))
    hooks.append(model.norm.register_forward_hook(on_norm))
    try:
        for batch in batches:
            model(batch.tokens, **batch.model_kwargs())
            tokens += batch.tokens.numel()
    finally:
        for h in hooks:
            h.remove()
    heads = []
    for i, block in enumerate(blocks):
        per_channel = sums[("heads", i)].sqrt()  # [num_heads * head_dim]
        heads.append(per_channel.view(-1, block.attention.head_dim).norm(dim=-1))
    return Importance(
        channels=[sums[("ffn", i)].sqrt() for i in range(len(blocks))],
        heads=heads,
        hidden=sums[("hidden", 0)].sqrt(),
        layers=(change / max(tokens, 1)).float(),
    )
