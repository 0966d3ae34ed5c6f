"""Eager CPU decoding's weight layout (suite.infer.decode_layout) and last-token head (LastTokenHead) change how
the weights are stored and multiplied, never the model: same logits, same greedy tokens, and models
with their own kernels (adapters, experts, quantized layers) are left as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from suite.config.schema import ModelConfig
from suite.infer.decode_layout import decode_layout, relayable
from suite.infer.decoder import BatchDecoder, LastTokenHead
from suite.models import build_model, materialize
from suite.models.lora import apply_lora

CONFIGS = {
    "gpt": ModelConfig(family="gpt", num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, max_seq_len=48),
    "llama-gqa": ModelConfig(
        family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_seq_len=48
    ),
    "llama-untied-bias": ModelConfig(
        family="llama", num_layers=2, hidden_size=64, num_heads=4, qkv_bias=True, tie_embeddings=False,
        vocab_size=128, max_seq_len=48,
    ),
    "llama-fused-headdim": ModelConfig(
        family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=24,
        fused_projections=True, vocab_size=128, max_seq_len=48,
    ),
}  # fmt: skip
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99], [12, 13, 14, 15, 16]]


def _model(cfg: ModelConfig) -> nn.Module:
    return materialize(build_model(cfg), "cpu", seed=3).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_relaid_model_gives_the_same_logits_and_shares_what_it_keeps(name):
    model = _model(CONFIGS[name])
    fast = decode_layout(model)
    assert fast is not model and relayable(model)
    for block in fast.layers.values():
        assert hasattr(block.attention, "wqkv") and not hasattr(block.attention, "wq")  # fused
        assert hasattr(block.feed_forward, "w13") == (CONFIGS[name].family == "llama")
        linears = [m for m in block.modules() if type(m) is nn.Linear]
        assert len(linears) == 4
        for linear in linears:  # every block weight: the [out, in] values over [in, out] storage
            assert linear.weight.t().is_contiguous() and not linear.weight.is_contiguous()
    for kept in ("tok_embeddings", "output", "norm"):  # shared storage, not copied
        assert getattr(fast, kept).weight.data_ptr() == getattr(model, kept).weight.data_ptr()
    tokens = torch.tensor([p[:3] for p in PROMPTS])
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), model(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_batched_decoding_keeps_the_plain_models_tokens(name):
    """The decoder relays the model and picks the head's form per batch size; the tokens are those of
    the compiled-free plain path (the same decoder with its layout and head undone)."""
    model = _model(CONFIGS[name])
    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731
    plain = BatchDecoder(model)
    plain.model, plain.head = model, None  # as before this layout: the model's own forward and head
    relaid = BatchDecoder(model)
    assert relaid.model is not model and relaid.head is not None
    for prompts in (PROMPTS[:1], PROMPTS):  # one row (transposed head) and three (streamed head)
        want = torch.stack(list(plain.generate(prompts, 20, pick)), 1)
        got = torch.stack(list(relaid.generate(prompts, 20, pick)), 1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wide_model_agrees_up_to_rounding(dtype):
    """At width 1024 the reordered sums differ in the last bits (fp32 ~3e-6): equal within rounding."""
    cfg = ModelConfig(
        family="llama", num_layers=1, hidden_size=1024, num_heads=8, num_kv_heads=2, vocab_size=256
    )
    model = _model(cfg).to(dtype)
    fast = decode_layout(model)
    assert next(fast.layers.parameters()).dtype == dtype
    tokens = torch.tensor([p[:3] for p in PROMPTS])
    with torch.no_grad():
        want, got = model(tokens).float(), fast(tokens).float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_in_place_relayout_keeps_one_copy_of_the_weights():
    model = _model(CONFIGS["llama-gqa"])
    tokens = torch.tensor([p[:3] for p in PROMPTS])
    with torch.no_grad():
        want = model(tokens)
    before = list(model.layers.parameters())  # held, so no new tensor can reuse a freed address
    old = {p.data_ptr() for p in before}
    embedding = model.tok_embeddings.weight.data_ptr()
    fast = decode_layout(model, in_place=True)
    assert fast is model and model.cfg.fused_projections and hasattr(model.layers["1"].attention, "wqkv")
    assert model.tok_embeddings.weight.data_ptr() == embedding
    new = {p.data_ptr() for p in model.layers.parameters()}
    # the projections are new tensors (without `before`, the old ones go with their blocks), the norms
    # the same
    assert len(new - old) == 4 * 2 and len(new & old) == 2 * 2
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), want, rtol=0, atol=1e-5)


def test_last_token_head_forms_agree():
    output = nn.Linear(64, 300, bias=True)
    head = LastTokenHead(output)
    hidden = torch.randn(5, 3, 64)
    want = output(hidden[:, -1])
    torch.testing.assert_close(head(hidden, output.weight), want, rtol=0, atol=1e-5)  # streamed form
    torch.testing.assert_close(head(hidden[:1], output.weight), want[:1], rtol=0, atol=1e-5)  # transposed


def test_models_with_their_own_kernels_are_not_relaid():
    lora = _model(CONFIGS["gpt"])
    apply_lora(lora, 4, 8.0, 0.0, ("wq", "wv"))
    moe = _model(
        ModelConfig(family="llama", num_layers=2, hidden_size=64, num_heads=4, num_experts=2, vocab_size=128)
    )
    for model in (lora, moe):
        assert not relayable(model) and decode_layout(model) is model
    # torchao's quantized weights are tensor subclasses with their own matmuls
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized = _model(CONFIGS["gpt"])
    quantize_(quantized.layers["1"].feed_forward, Int8WeightOnlyConfig())
    assert not relayable(quantized) and decode_layout(quantized) is quantized
