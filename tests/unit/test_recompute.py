"""Activation recompute: same loss and gradients as no recompute, same names, less saved memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, RecomputeConfig
from suite.models import build_model, materialize
from suite.parallel.recompute import apply_recompute, check_recompute, recomputed_layers

GRANULARITIES = ("full", "full_attn", "core_attn")
FAMILIES = {
    "gpt": ModelConfig(num_layers=3, hidden_size=32, num_heads=4, vocab_size=97, max_seq_len=16),
    "llama": ModelConfig(
        family="llama",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=97,
        max_seq_len=16,
        tie_embeddings=False,
        ffn_hidden_size=48,
    ),
    # per-head q/k norms, heads wider than hidden / heads, and a Qwen3-MoE layer
    "qwen3_moe": ModelConfig(
        family="qwen3",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=97,
        max_seq_len=16,
        ffn_hidden_size=48,
        num_experts=4,
        top_k=2,
        norm_topk_prob=True,
        moe_layers=[1],
        moe_ffn_hidden_size=16,
    ),
    # MLA (core_attn wraps its own core), sigmoid routing with the aux-free bias, a shared expert
    "deepseek_v3": ModelConfig(
        family="deepseek_v3",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        vocab_size=97,
        max_seq_len=16,
        tie_embeddings=False,
        ffn_hidden_size=48,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_experts=4,
        top_k=2,
        moe_layers=[1, 2],
        moe_ffn_hidden_size=16,
        num_shared_experts=1,
        router_score="sigmoid",
        router_bias_update_rate=0.01,
    ),
}


def _model(cfg: ModelConfig, recompute: RecomputeConfig | None = None, on_meta: bool = True):
    model = build_model(cfg, "meta" if on_meta else "cpu")
    if recompute is not None and on_meta:
        apply_recompute(model, recompute)  # before materialising, as parallelize does
    materialize(model, "cpu", seed=7)
    if recompute is not None and not on_meta:
        apply_recompute(model, recompute)
    return model


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _OpCounter(TorchDispatchMode):
    """Counts attention (SDPA) and MLP (GELU) forward kernels."""

    def __init__(self):
        super().__init__()
        self.counts = {"attn": 0, "mlp": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "backward" not in name:
            if "scaled_dot_product" in name:
                self.counts["attn"] += 1
            elif name.startswith("gelu"):
                self.counts["mlp"] += 1
        return func(*args, **(kwargs or {}))


def _saved_bytes(model, tokens) -> int:
    """Bytes of distinct storages autograd keeps for backward after one forward."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
    del logits
    return sum(b for ptr, b in seen.items() if ptr not in params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_same_loss_and_grads_as_none(family, granularity):
    cfg = FAMILIES[family]
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(_model(cfg), tokens)
    for on_meta in (True, False):
        model = _model(cfg, RecomputeConfig(granularity=granularity), on_meta=on_meta)
        loss, grads = _loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    if granularity == "full":  # it did recompute: the blocks' inner activations are not kept
        assert _saved_bytes(model, tokens) < _saved_bytes(_model(cfg), tokens)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_names_unchanged_and_deepcopy_rebinds(granularity):
    cfg = FAMILIES["llama"]
    plain = build_model(cfg)
    model = build_model(cfg)
    apply_recompute(model, RecomputeConfig(granularity=granularity))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert "layers.0.attention.wq.weight" in model.state_dict()
    # A deep copy (pipeline stages copy the meta model) recomputes its own blocks, not the original's.
    clone = materialize(copy.deepcopy(model), "cpu", seed=7)
    ref = _model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_loss_and_grads(clone, tokens)[0], _loss_and_grads(ref, tokens)[0])
    with pytest.raises(RuntimeError, match="already"):
        apply_recompute(model, RecomputeConfig(granularity=granularity))


def test_recompute_reruns_forward_in_backward_and_saves_less():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, max_seq_len=64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(2))
    saved = {}
    for granularity in ("none", *GRANULARITIES):
        model = _model(cfg, RecomputeConfig(granularity=granularity))
        with _OpCounter() as calls:  # forward kernels, also those rerun during backward
            _loss_and_grads(model, tokens)
        expected = {"none": (2, 2), "full": (4, 4), "full_attn": (4, 2), "core_attn": (4, 2)}[granularity]
        assert (calls.counts["attn"], calls.counts["mlp"]) == expected, granularity
        saved[granularity] = _saved_bytes(model, tokens)
    assert saved["full"] < saved["full_attn"] < saved["none"]
    assert saved["core_attn"] < saved["none"]


def test_skip_and_num_layers_select_global_layer_ids():
    assert recomputed_layers([0, 1, 2, 3], RecomputeConfig("none")) == []
    assert recomputed_layers([0, 1, 2, 3], RecomputeConfig("full")) == [0, 1, 2, 3]
    assert recomputed_layers([0, 1, 2, 3], RecomputeConfig("full", skip_layers=1)) == [1, 2, 3]
    assert recomputed_layers([0, 1, 2, 3], RecomputeConfig("full", num_layers=2, skip_layers=1)) == [1, 2]
    assert (
        recomputed_layers([2, 3], RecomputeConfig("core_attn", num_layers=1, skip_layers=1)) == []
    )  # a pp stage
    assert recomputed_layers([2, 3], RecomputeConfig("core_attn", skip_layers=3)) == [3]

    cfg = FAMILIES["gpt"]
    model = build_model(cfg)
    apply_recompute(model, RecomputeConfig("full", num_layers=1, skip_layers=1))
    marked = [k for k, b in model.layers.items() if getattr(b, "_suite_recompute", None)]
    assert marked == ["1"]
    assert "forward" not in model.layers["0"].__dict__ and "forward" not in model.layers["2"].__dict__
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    materialize(model, "cpu", seed=7)
    torch.testing.assert_close(_loss_and_grads(model, tokens)[0], _loss_and_grads(_model(cfg), tokens)[0])


def test_generation_with_kv_cache_is_unaffected():
    from suite.models.transformer import KVCache

    cfg = FAMILIES["llama"]
    ref, model = _model(cfg), _model(cfg, RecomputeConfig("full"))
    tokens = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        outs = []
        for m in (ref, model):
            cache = KVCache.empty(m, 1, 16)
            outs.append(torch.cat([m(tokens[:, :4], kv_cache=cache), m(tokens[:, 4:], kv_cache=cache)], 1))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (RecomputeConfig("everything"), "recompute.granularity"),
        (RecomputeConfig("full", skip_layers=-1), "recompute.skip_layers"),
        (RecomputeConfig("full", num_layers=-2), "recompute.num_layers"),
        (RecomputeConfig("full", skip_layers=4), "skips every one"),
    ],
)
def test_impossible_settings_are_one_line_errors(cfg, match):
    with pytest.raises(ConfigError, match=match) as info:
        check_recompute(cfg, num_layers=4)
    assert "\n" not in str(info.value)
