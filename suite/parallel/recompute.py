"""Activation recompute (checkpointing) at the granularities of PaddleFleetX / Megatron-LM.

    none       nothing is recomputed
    full       the whole TransformerBlock: only its input is kept, everything inside is
               recomputed during backward (least memory, ~one extra forward)
    full_attn  the attention sub-layer (attention_norm + attention): the MLP keeps its activations
    core_attn  only CoreAttention, softmax(QK^T)V (Megatron's "selective" recompute): the
               cheapest to redo, and the s x s scores are never kept

`recompute.skip_layers` leaves the first N layers (by global layer index, so the same layers
whatever pipeline stage holds them) un-recomputed; `recompute.num_layers` (None: all that
remain) bounds how many are recomputed after those.

Modules are not wrapped: the chosen module's `forward` is replaced on the instance by one that
runs the original under `torch.utils.checkpoint` (use_reentrant=False). Parameter names, and so
state-dict keys, TP plans and checkpoints, stay exactly as in the plain model, and module hooks
(TP layouts, FSDP unshard) still run around the recomputed region.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from suite.config.errors import ConfigError
from suite.config.schema import RecomputeConfig

GRANULARITIES = ("none", "full", "full_attn", "core_attn")
_MARK = "_suite_recompute"


def _checkpointed(fn: Callable, *args, **kwargs):
    """Run fn under non-reentrant checkpoint when autograd will need its activations."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _block_forward(self, x, rope=None, mask=None, cache=None):
    inner = functools.partial(type(self).forward, self)
    if cache is not None:  # decoding with a KV cache writes into buffers: never recompute
        return inner(x, rope, mask, cache)
    return _checkpointed(inner, x, rope, mask, None)


def _attention_sublayer(self, x, rope, mask, cache):
    return self.attention(self.attention_norm(x), rope, mask, cache)


def _block_forward_attn_recomputed(self, x, rope=None, mask=None, cache=None):
    """TransformerBlock.forward with attention_norm + attention recomputed."""
    if cache is None:
        attn = _checkpointed(functools.partial(_attention_sublayer, self), x, rope, mask, None)
    else:
        attn = _attention_sublayer(self, x, rope, mask, cache)
    x = x + self.dropout(attn)
    return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


def _core_forward(self, q, k, v, mask=None):
    return _checkpointed(functools.partial(type(self).forward, self), q, k, v, mask)


def _replace_forward(module: nn.Module, fn: Callable) -> None:
    # A bound method on the instance: deepcopy rebinds it to the copy, hooks still run around it.
    if "forward" in module.__dict__:
        raise RuntimeError(
            f"{type(module).__name__} already has an instance-level forward; apply recompute first"
        )
    module.forward = types.MethodType(fn, module)


def _recompute_block(block: nn.Module) -> None:
    _replace_forward(block, _block_forward)


def _recompute_attention_sublayer(block: nn.Module) -> None:
    _replace_forward(block, _block_forward_attn_recomputed)


def _recompute_core_attention(block: nn.Module) -> None:
    _replace_forward(block.attention.core, _core_forward)


APPLY = {
    "full": _recompute_block,
    "full_attn": _recompute_attention_sublayer,
    "core_attn": _recompute_core_attention,
}


def recomputed_layers(layer_ids: list[int], cfg: RecomputeConfig) -> list[int]:
    """The global layer indices (of those given) that `cfg` recomputes."""
    if cfg.granularity == "none":
        return []
    first = cfg.skip_layers
    last = None if cfg.num_layers is None else first + cfg.num_layers
    return [i for i in layer_ids if i >= first and (last is None or i < last)]


def check_recompute(cfg: RecomputeConfig, num_layers: int) -> None:
    """One-line errors for impossible recompute settings (suite.preflight runs it before launch)."""
    if cfg.granularity not in GRANULARITIES:
        raise ConfigError(
            f"recompute.granularity={cfg.granularity!r} is not supported; use one of: {', '.join(GRANULARITIES)}"
        )
    if cfg.skip_layers < 0:
        raise ConfigError(f"recompute.skip_layers={cfg.skip_layers} must be 0 or more")
    if cfg.num_layers is not None and cfg.num_layers < 0:
        raise ConfigError(f"recompute.num_layers={cfg.num_layers} must be 0 or more (or null for all)")
    if cfg.granularity != "none" and cfg.skip_layers >= num_layers:
        raise ConfigError(
            f"recompute.skip_layers={cfg.skip_layers} skips every one of model.num_layers={num_layers} layers; "
            f"use at most {num_layers - 1}, or recompute=none"
        )


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> None:
    """In place: checkpoint the configured part of each selected block of `model.layers`.

    Works on a meta-device or materialised model, before or after TP; call it before FSDP so
    FSDP's hooks sit outside the recomputed region. Applying twice raises (it would nest).
    """
    if cfg.granularity == "none":
        return
    blocks = {int(key): block for key, block in model.layers.items()}
    for i in recomputed_layers(sorted(blocks), cfg):
        block = blocks[i]
        if getattr(block, _MARK, None):
            raise RuntimeError(f"layers.{i} already has recompute={getattr(block, _MARK)} applied")
        APPLY[cfg.granularity](block)
        setattr(block, _MARK, cfg.granularity)
