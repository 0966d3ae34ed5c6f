"""The two inference graphs of `suite export format=torch_export|onnx`: prefill and one decode step.

Both carry the KV cache explicitly, stacked over layers as [layers, batch, kv heads, length, head_dim]:

    prefill(tokens [b, s])                        -> logits [b, s, V], keys, values   (length s)
    decode(tokens [b, 1], past_keys, past_values) -> logits [b, 1, V], keys, values   (length past + 1)

Batch, prompt length and past length are dynamic dimensions, so one program serves every batch and
position up to model.max_seq_len. The model runs unchanged: a GrowingKVCache (concatenation, no
in-place writes) is what torch.export and the ONNX exporter trace; positions come from the past length.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.export import Dim

from suite.models.moe import moe_modules
from suite.models.transformer import GrowingKVCache, Transformer, cache_dims

MAX_BATCH = 1024  # the dynamic batch's upper bound in the exported programs


class PrefillGraph(nn.Module):
    """The prompt, all at once: logits of every position and the cache it fills."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, b = self.model, tokens.shape[0]
        dims = cache_dims(m)
        new = m.tok_embeddings.weight.new_zeros
        cache = GrowingKVCache(
            [new(b, k[0], 0, k[1]) for k, _ in dims], [new(b, v[0], 0, v[1]) for _, v in dims]
        )
        logits = m(tokens, kv_cache=cache)
        return logits, torch.stack(cache.keys), torch.stack(cache.values)


class DecodeGraph(nn.Module):
    """One new token per row after `past` cached positions."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(
        self, tokens: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = GrowingKVCache(list(past_keys.unbind(0)), list(past_values.unbind(0)))
        logits = self.model(tokens, kv_cache=cache)
        return logits, torch.stack(cache.keys), torch.stack(cache.values)


INPUT_NAMES = {"prefill": ["tokens"], "decode": ["tokens", "past_keys", "past_values"]}
OUTPUT_NAMES = ["logits", "keys", "values"]


def example_inputs(model: Transformer, batch: int = 2, seq: int = 8) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs to trace each graph with (sizes other than the 0/1 torch.export would specialise on)."""
    p = model.tok_embeddings.weight
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq), device=p.device)
    (k_heads, k_dim), (v_heads, v_dim) = cache_dims(model)[0]  # the same in every layer
    keys = p.new_zeros(len(model.layers), batch, k_heads, seq, k_dim)
    values = p.new_zeros(len(model.layers), batch, v_heads, seq, v_dim)
    return {"prefill": (tokens,), "decode": (tokens[:, :1], keys, values)}


def dynamic_shapes(model: Transformer) -> dict[str, dict[str, dict[int, Dim]]]:
    """Batch, prompt length and past length: dynamic, within what the model's positions reach."""
    limit = model.cfg.max_seq_len
    batch = Dim("batch", min=1, max=MAX_BATCH)
    seq = Dim("seq", min=2, max=limit)  # a one-token prompt runs too (causal over one position)
    past = Dim("past", min=2, max=limit - 1)
    cache = {1: batch, 3: past}
    return {
        "prefill": {"tokens": {0: batch, 1: seq}},
        "decode": {"tokens": {0: batch}, "past_keys": cache, "past_values": cache},
    }


def graph_modules(model: Transformer) -> dict[str, nn.Module]:
    return {"prefill": PrefillGraph(model), "decode": DecodeGraph(model)}


def prepare_for_export(model: Transformer) -> Transformer:
    """Inference mode, the attention the exporters trace (SDPA: `explicit` is a training-time choice)."""
    model.eval()
    for layer in model.layers.values():
        layer.attention.core.explicit = False
    return model


@contextmanager
def traceable_moe(model: Transformer) -> Iterator[None]:
    """MoE layers in their dense form while the exporters trace: routing sends a data-dependent
    number of tokens to each expert, which they cannot trace; every expert on every token, weighted
    by the router's choice (zero elsewhere), gives the same logits with static shapes
    (suite.models.moe MoEFeedForward.dense) at num_experts / top_k times the routed experts' work.
    Restored after, so the model the export is checked against routes sparsely."""
    modules = moe_modules(model)
    for module in modules:
        module.dense = True
    try:
        yield
    finally:
        for module in modules:
            module.dense = False


@torch.no_grad()
def export_programs(model: Transformer) -> dict[str, torch.export.ExportedProgram]:
    """torch.export programs of both graphs, with dynamic batch, prompt and past lengths."""
    prepare_for_export(model)
    inputs, shapes = example_inputs(model), dynamic_shapes(model)
    with traceable_moe(model):
        return {
            name: torch.export.export(module, inputs[name], dynamic_shapes=shapes[name])
            for name, module in graph_modules(model).items()
        }
