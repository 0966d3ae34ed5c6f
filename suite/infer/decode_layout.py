"""The weight layout eager CPU decoding reads fastest: fused projections, block weights stored transposed.

A decode step multiplies a few rows (one per prompt) by every weight of the model, so it is bound by
how the matmul library streams the weights, not by arithmetic. Two changes to the layout, neither to
the values (bench/generate.py, gpt-tiny, fp32, 2 cores, against transformers' generate in one run):
- q/k/v and gate/up as one matmul each (the model's own `model.fused_projections` form: fewer, wider
  calls, as in training);
- every block weight held as its [in, out] transpose (the logical [out, in] tensor is a view of it),
  so `x @ W^T` reads contiguous rows: oneDNN/MKL otherwise repack the stored [out, in] matrix at every
  call for a few-row input.
Together: 1.52x -> 1.78x transformers' decode at batch 1 (1.22x -> 1.48x at batch 8 before the
streamed head of suite.infer.decoder.LastTokenHead). The values are the same up to rounding (the same
dot products, accumulated in another order: ~3e-6 of the logits at width 1024, fp32).

The relaid model is a new module that shares every tensor it does not change (embeddings, norms, the
head), or the model itself relaid block by block (`in_place`); only plain dense models on CPU are relaid (no adapters, experts, quantized or fake-quantized
layers, which bring their own kernels), anything else decodes as it is.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from suite.config.schema import ModelConfig
from suite.models.transformer import FeedForward, Transformer, TransformerBlock, build_model, fuse_state_dict

BLOCK_LINEARS = ("wq", "wk", "wv", "wqkv", "wo", "w1", "w2", "w3", "w13")


def relayable(model: nn.Module) -> bool:
    """A plain dense suite Transformer on CPU whose block projections are bare nn.Linear layers."""
    if type(model) is not Transformer or model.tok_embeddings is None or model.output is None:
        return False
    for layer in model.layers.values():
        if type(layer.feed_forward) is not FeedForward:  # MoE experts have their own grouped kernels
            return False
        for name, module in layer.named_modules():
            if name.rpartition(".")[2] in BLOCK_LINEARS and (
                type(module) is not nn.Linear
                or type(module.weight) is not nn.Parameter
                or module.weight.device.type != "cpu"
            ):
                return False
    return True


def _transposed_storage(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] values, stored as their contiguous [in, out] transpose."""
    return weight.detach().t().contiguous().t()


def _relaid_block(block: TransformerBlock, cfg: ModelConfig) -> TransformerBlock:
    """`block` with fused projections and (fp32) transposed block weights; its norms' tensors are shared."""
    state = fuse_state_dict(cfg, block.state_dict())
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        # fp32 only: torch's half-precision CPU kernels read the stored [out, in] form ~9x faster
        # than the transpose for one row (2-core AMD EPYC, AVX2: fp16 23.7 ms against 206 ms for
        # SmolLM2-135M's block weights), so bf16/fp16 weights keep it
        if kind == "weight" and module.rpartition(".")[2] in BLOCK_LINEARS and tensor.dtype == torch.float32:
            state[name] = _transposed_storage(tensor)
    with torch.device("meta"):
        fast = TransformerBlock(cfg, block.layer_id)
    fast.load_state_dict(state, assign=True, strict=True)
    return fast.eval().requires_grad_(False)


@torch.no_grad()
def decode_layout(model: nn.Module, in_place: bool = False) -> nn.Module:
    """`model` relaid for eager CPU decoding (module docstring), or `model` itself when it is not
    `relayable`. The result is in eval mode and must not be trained or saved (its block weights are
    non-contiguous views). A new model by default, which shares all but the block weights with
    `model`; `in_place=True` relays `model` itself block by block, so a large model never has two
    copies of its weights (what `suite generate` does with the model it loaded)."""
    if not relayable(model):
        return model
    cfg = dataclasses.replace(model.cfg, fused_projections=True)
    if in_place:
        fast = model
    else:
        fast = build_model(cfg)  # on meta: every module below is replaced or shared
        for name in ("tok_embeddings", "pos_embeddings", "dropout", "norm", "output"):
            setattr(fast, name, getattr(model, name))
        fast.rope_inv_freq = model.rope_inv_freq  # a buffer (llama) or None
    fast.cfg = cfg  # first: an in-place relayout that fails part-way still names fused blocks in cfg
    for key, block in list(model.layers.items()):
        fast.layers[key] = _relaid_block(block, cfg)
    return fast.eval()
