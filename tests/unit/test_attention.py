"""model.attention=explicit: the materialised score matrix computes what F.scaled_dot_product_attention does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from suite.config.schema import ModelConfig
from suite.models import build_model, materialize
from suite.models.transformer import explicit_attention

GEN = torch.Generator().manual_seed(0)


def qkv(heads: int, kv_heads: int, seq: int = 16, dtype=torch.float64):
    shapes = ((2, heads, seq, 8), (2, kv_heads, seq, 8), (2, kv_heads, seq, 8))
    return [torch.randn(s, generator=GEN, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_explicit_attention_and_its_gradients_equal_sdpa(kv_heads, masked):
    q, k, v = qkv(4, kv_heads)
    mask = None
    if masked:  # packed documents: block-diagonal causal, [b, 1, s, s]
        doc = torch.arange(16) // 6
        mask = ((doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril())[None, None]
    ours = explicit_attention(q, k, v, mask)
    if mask is None:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    else:
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


def test_explicit_attention_in_bf16_stays_close_to_the_fp32_result():
    q, k, v = qkv(4, 4, seq=64, dtype=torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = explicit_attention(*(t.detach().bfloat16() for t in (q, k, v)))
    assert (low.float() - ref).abs().max() < 0.05  # bf16 scores and outputs: a few ulps of values ~1


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_models_with_either_attention_give_the_same_logits_and_gradients(family):
    cfg = ModelConfig(
        family=family,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        vocab_size=64,
        max_seq_len=16,
        num_kv_heads=2,
    )
    tokens = torch.randint(0, 64, (2, 12), generator=GEN)
    outputs = []
    for attention in ("sdpa", "explicit"):
        model = materialize(
            build_model(dataclasses.replace(cfg, attention=attention)), "cpu", seed=3
        ).double()
        logits = model(tokens)
        logits.logsumexp(-1).sum().backward()
        outputs.append((logits, [p.grad for p in model.parameters()]))
    (sdpa_logits, sdpa_grads), (explicit_logits, explicit_grads) = outputs
    torch.testing.assert_close(explicit_logits, sdpa_logits, rtol=0, atol=1e-10)
    for ours, ref in zip(explicit_grads, sdpa_grads):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
