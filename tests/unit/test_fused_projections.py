"""model.fused_projections: one matmul for q/k/v (wqkv) and for the SwiGLU gate/up (w13).

The fused model is the unfused one with its weights laid side by side: same seeded init, same
logits, state dicts convertible both ways, and LoRA adapts the fused layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from suite.config.schema import ModelConfig
from suite.models import build_model, materialize
from suite.models.lazy import as_lazy
from suite.models.lora import LoRALinear, apply_lora, lora_modules, merge_lora
from suite.models.transformer import fuse_state_dict, split_qkv, unfuse_state_dict

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
CONFIGS = {
    "gpt": ModelConfig(
        family="gpt", num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, max_seq_len=32
    ),
    "llama-gqa-bias": ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        qkv_bias=True,
        vocab_size=128,
    ),
    "llama-moe-shared": ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=1,
        num_experts=2,
        num_shared_experts=1,
        vocab_size=128,
    ),
}


def pair(name: str, seed: int = 5):
    cfg = CONFIGS[name]
    fused_cfg = dataclasses.replace(cfg, fused_projections=True)
    plain = materialize(build_model(cfg), "cpu", seed)
    fused = materialize(build_model(fused_cfg), "cpu", seed)
    return fused_cfg, plain, fused


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_model_is_the_unfused_model(name):
    fused_cfg, plain, fused = pair(name)
    assert any(".wqkv." in k for k in fused.state_dict())
    assert ("w13.weight" in " ".join(fused.state_dict())) == (fused_cfg.family == "llama")
    unfused = unfuse_state_dict(fused_cfg, fused.state_dict())  # the seeded init is the same values
    assert unfused.keys() == plain.state_dict().keys()
    assert all(torch.equal(unfused[k], v) for k, v in plain.state_dict().items())
    refused = fuse_state_dict(fused_cfg, plain.state_dict())
    assert all(torch.equal(refused[k], v) for k, v in fused.state_dict().items())
    # on lazy tensors (streaming HF import/export): the same values, a shard read as a box
    lazy = fuse_state_dict(fused_cfg, {k: as_lazy(v) for k, v in plain.state_dict().items()})
    for k, v in fused.state_dict().items():
        assert torch.equal(as_lazy(lazy[k]).read(), v), k
        half = ((0, v.shape[0] // 2), *((0, n) for n in v.shape[1:]))
        assert torch.equal(as_lazy(lazy[k]).read(half), v[: v.shape[0] // 2]), k
    lazy_back = unfuse_state_dict(fused_cfg, {k: as_lazy(v) for k, v in fused.state_dict().items()})
    assert all(torch.equal(as_lazy(lazy_back[k]).read(), v) for k, v in plain.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(fused(TOKENS), plain(TOKENS), atol=1e-5, rtol=1e-5)


def test_every_whole_kv_group_slice_is_a_smaller_attention():
    """What a tp rank holds (a contiguous Shard(0) slice of wqkv) is whole q, k and v heads."""
    cfg = dataclasses.replace(CONFIGS["llama-gqa-bias"], fused_projections=True)
    wqkv = materialize(build_model(cfg), "cpu", 1).layers["0"].attention.wqkv.weight.detach()
    wq, wk, wv = split_qkv(wqkv, cfg.num_heads, 2)
    first_rank = wqkv[: wqkv.shape[0] // 2]
    q, k, v = split_qkv(first_rank, cfg.num_heads // 2, 1)
    assert torch.equal(q, wq[: wq.shape[0] // 2]) and torch.equal(k, wk[:16]) and torch.equal(v, wv[:16])


def test_lora_adapts_the_fused_layers_and_merges_exactly():
    fused_cfg, _, model = pair("llama-gqa-bias")
    apply_lora(model, rank=4, target_modules=("wq", "wv", "wo", "w1"), seed=3)  # unfused names
    adapted = sorted({name.rsplit(".", 1)[-1] for name in lora_modules(model)})
    assert adapted == ["w13", "wo", "wqkv"]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=gen) * 0.05)
        adapted_logits = model(TOKENS)
        merge_lora(model)
        torch.testing.assert_close(model(TOKENS), adapted_logits, atol=1e-5, rtol=1e-5)
