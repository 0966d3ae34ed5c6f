"""LoRA: identity at init, only adapters train, names preserved, merge exact, meta-device friendly."""

from __future__ import annotations

import pytest
import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models import build_model, materialize
from suite.models.lora import (
    LoRALinear,
    apply_lora,
    count_trainable,
    init_lora,
    load_lora,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    save_lora,
)

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def cfg_for(family: str) -> ModelConfig:
    return ModelConfig(
        family=family,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2 if family == "llama" else None,
        vocab_size=128,
        max_seq_len=32,
    )


def base(family: str = "gpt") -> torch.nn.Module:
    return materialize(build_model(cfg_for(family)), "cpu", seed=7)


def randomize_b(model: torch.nn.Module) -> None:
    """Stand in for training: give every B a non-zero value."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_unchanged_at_init_and_only_adapters_train(family):
    model = base(family)
    with torch.no_grad():
        ref = model(TOKENS)
    plain_keys = set(model.state_dict())
    apply_lora(model, rank=4, alpha=8, seed=3)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), ref)  # B = 0: bit-identical
    keys = set(model.state_dict())
    lora_keys = keys - plain_keys
    assert plain_keys <= keys  # every base weight keeps its name (layers.0.attention.wq.weight ...)
    ffn = ("w1", "w2", "w3") if family == "llama" else ("w1", "w2")
    assert lora_keys == {
        f"layers.{i}.{part}.{t}.lora_{ab}.weight"
        for i in range(2)
        for ab in "ab"
        for part, names in (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ffn))
        for t in names
    }
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == lora_keys
    loss = model(TOKENS).logsumexp(-1).mean()
    loss.backward()
    assert all((p.grad is None) != (n in lora_keys) for n, p in model.named_parameters())


def test_trainable_ratio_under_five_percent_for_gpt_tiny_rank_8():
    cfg = ModelConfig()  # gpt-tiny's architecture: 4 layers, 256 wide, vocab 8192
    model = build_model(cfg)  # meta: counting needs no memory
    before = count_trainable(model)
    apply_lora(model, rank=8, alpha=16)
    counts = count_trainable(model)
    print(
        f"gpt-tiny LoRA rank 8 on {', '.join(model.lora_spec.target_modules)}: {counts.trainable:,} of "
        f"{counts.total:,} parameters trainable ({counts.ratio:.2%})"
    )
    assert counts.total == before.total + counts.trainable
    assert counts.ratio < 0.05
    assert counts.trainable == 4 * (4 * 8 * (256 + 256) + 2 * 8 * (256 + 1024))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_merge_gives_the_adapted_logits_and_plain_names(family):
    model = base(family)
    plain_keys = list(model.state_dict())
    apply_lora(model, rank=4, alpha=16, dropout=0.1, seed=3)
    randomize_b(model)
    model.eval()
    with torch.no_grad():
        adapted = model(TOKENS)
        assert not torch.allclose(adapted, base(family)(TOKENS))
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert list(model.state_dict()) == plain_keys
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), adapted, rtol=1e-5, atol=1e-5)
    plain = base(family)
    plain.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(TOKENS), adapted, rtol=1e-5, atol=1e-5)


def test_meta_device_then_materialize_matches_eager_application():
    eager = apply_lora(base(), rank=4, alpha=8, seed=11)
    meta = build_model(cfg_for("gpt"))
    apply_lora(meta, rank=4, alpha=8)
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, "cpu", seed=7)  # random init touches every parameter, adapters included
    init_lora(meta, seed=11)
    for (n1, p1), (n2, p2) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert all(p.requires_grad == ("lora_" in n) for n, p in meta.named_parameters())
    a = dict(meta.named_parameters())["layers.1.attention.wq.lora_a.weight"]
    assert a.abs().max() <= 1 / 64**0.5 and a.std() > 0


def test_adapter_state_round_trip(tmp_path):
    model = apply_lora(base(), rank=4, alpha=8)
    randomize_b(model)
    sd = lora_state_dict(model)
    assert sd and all(".lora_" in k for k in sd)
    other = apply_lora(base(), rank=4, alpha=8, seed=99)
    load_lora_state_dict(other, sd)
    with torch.no_grad():
        torch.testing.assert_close(other(TOKENS), model(TOKENS), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="do not match"):
        load_lora_state_dict(apply_lora(base(), rank=4, target_modules=("wq",)), sd)
    save_lora(model, tmp_path / "adapters")
    fresh = load_lora(base(), tmp_path / "adapters")
    assert fresh.lora_spec == model.lora_spec
    with torch.no_grad():
        torch.testing.assert_close(fresh(TOKENS), model(TOKENS), rtol=0, atol=0)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="target_modules"):
        apply_lora(base(), target_modules=("wq", "query"))
    with pytest.raises(ConfigError, match="tied"):
        apply_lora(base(), target_modules=("output",))
    with pytest.raises(ConfigError, match="rank"):
        apply_lora(base(), rank=0)
    model = apply_lora(base(), rank=2)
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, rank=2)


# ---- Mixture-of-Experts: per-expert adapters on the stacked expert weights --------------------------
def moe_cfg(impl: str = "grouped") -> ModelConfig:
    return ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=128,
        max_seq_len=32,
        num_experts=4,
        top_k=2,
        moe_ffn_hidden_size=16,
        moe_impl=impl,
    )


def adapted_moe(impl: str, targets: list[str]) -> torch.nn.Module:
    """A MoE model with LoRA on `targets` and non-zero B factors (so the adapters change the output)."""
    from suite.models.lora import lora_parameters

    model = materialize(build_model(moe_cfg(impl)), "cpu", seed=7)
    apply_lora(model, 4, 8.0, 0.0, targets, seed=3)
    with torch.no_grad():
        for name, param in sorted(lora_parameters(model).items()):
            if ".lora_b." in name:
                gen = torch.Generator().manual_seed(len(name) + param.numel())
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def test_expert_targets_adapt_the_stacked_weights_per_expert():
    """w1/w2/w3 name the routed experts' stacked weights too; `experts` names them alone; the
    router and the base stay frozen; `experts` on a dense model matches nothing."""
    model = adapted_moe("loop", ["wq", "w1", "w2", "w3"])
    state = lora_state_dict(model)
    assert state["layers.0.feed_forward.experts.lora_a.w1"].shape == (4, 4, 32)  # [E, rank, in]
    assert state["layers.0.feed_forward.experts.lora_b.w2"].shape == (4, 32, 4)  # [E, out, rank]
    assert "layers.0.attention.wq.lora_a.weight" in state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(state)
    only = lora_state_dict(adapted_moe("loop", ["experts"]))
    assert {k.rsplit(".", 1)[1] for k in only} == {"w1", "w2", "w3"}
    assert all(".experts.lora_" in k for k in only)
    with pytest.raises(ConfigError, match="match no linear layer"):
        apply_lora(base("llama"), 4, 8.0, 0.0, ["experts"])


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_expert_adapters_compute_like_the_per_expert_loop_and_merge_exactly(impl):
    """The grouped / padded expert compute with adapters gives the loop's logits and adapter
    gradients, and merging folds B[e] A[e] * alpha/rank into each expert's weight: same logits,
    plain names."""
    from suite.models.lora import lora_parameters

    out, grads = {}, {}
    for kind in ("loop", impl):
        model = adapted_moe(kind, ["wq", "wv", "w1", "w2", "w3"])
        logits = model(TOKENS)
        logits.square().mean().backward()
        out[kind] = logits.detach()
        grads[kind] = {n: p.grad.clone() for n, p in lora_parameters(model).items()}
    assert (out[impl] - out["loop"]).abs().max() <= 1e-5
    for name, ref in grads["loop"].items():
        assert (grads[impl][name] - ref).norm() <= 1e-5 * ref.norm().clamp_min(1e-12), name
    assert any(".experts.lora_a." in n and g.norm() > 0 for n, g in grads["loop"].items())
    plain = adapted_moe(impl, ["wq", "wv", "w1", "w2", "w3"])
    merge_lora(plain)
    assert not any("lora" in k for k in plain.state_dict())
    with torch.no_grad():
        assert (plain(TOKENS) - out["loop"]).abs().max() <= 1e-5
        unadapted = materialize(build_model(moe_cfg(impl)), "cpu", seed=7)(TOKENS)
    assert (unadapted - out["loop"]).abs().max() > 1e-3  # the adapters did change the model


def test_experts_target_needs_a_moe_base():
    """`experts` in finetune.lora.target_modules on a dense base: one ConfigError before launch."""
    from suite.config.compose import compose_config, to_object
    from suite.finetune.checks import check_finetune_layout

    targets = ["finetune.method=lora", "finetune.lora.target_modules=[wq,experts]"]
    with pytest.raises(ConfigError, match="names experts, but .* is dense"):
        check_finetune_layout(to_object(compose_config(["recipe=sft-tiny", *targets])), None)
    moe = to_object(compose_config(["recipe=moe-tiny", *targets]))
    assert moe.model.num_experts and "experts" in moe.finetune.lora.target_modules
    check_finetune_layout(moe, None)


# ---- LoRA against its formula, written out by hand (issue 39: the tests above compare the layer with
# itself, so a scaling of alpha instead of alpha / rank passed them) -----------------------------------
RANK, ALPHA = 4, 8.0  # alpha / rank = 2: scaling by alpha (8), by 1 / rank or by 1 is off by 4x or more


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_adapted_linear_computes_the_hand_written_formula(family):
    """y = x W^T + b + (x A^T B^T) * alpha / r for every adapted linear of the model (its input and
    output caught by a forward hook), and merging sets W to W + B A * alpha / r."""
    model = apply_lora(base(family), rank=RANK, alpha=ALPHA, seed=3)
    randomize_b(model)
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str):
        return lambda module, args, out: seen.__setitem__(name, (args[0], out))

    hooks = [m.register_forward_hook(keep(name)) for name, m in adapted.items()]
    with torch.no_grad():
        model(TOKENS)
    for hook in hooks:
        hook.remove()
    assert seen.keys() == adapted.keys() and len(seen) >= 12
    merged = {}
    for name, m in adapted.items():
        x, y = seen[name]
        w, a, b = m.weight, m.lora_a.weight, m.lora_b.weight
        bias = m.bias if m.bias is not None else 0.0
        want = x @ w.T + bias + (x @ a.T @ b.T) * (ALPHA / RANK)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6, msg=name)
        assert (want - (x @ w.T + bias)).abs().max() > 1e-2, name  # the update is not negligible
        merged[name] = (w + (b @ a) * (ALPHA / RANK)).detach().clone()
    merge_lora(model)
    for name, want in merged.items():
        torch.testing.assert_close(model.get_submodule(name).weight, want, rtol=1e-6, atol=1e-7, msg=name)


def test_expert_adapters_merge_the_hand_written_update():
    """Each routed expert's stacked weight becomes W[e] + B[e] A[e] * alpha / r (one matmul per
    expert, written out); the merged model's logits equal the adapted one's (checked above for the
    grouped, padded and loop computes), so this pins the experts' forward scaling too."""
    model = adapted_moe("loop", ["w1", "w2", "w3"])
    stacks = [m for m in model.modules() if isinstance(getattr(m, "lora_a", None), torch.nn.ParameterDict)]
    assert stacks
    want = {}
    for i, m in enumerate(stacks):
        for name, a in m.lora_a.items():
            b, w = m.lora_b[name], getattr(m, name)
            want[i, name] = torch.stack([w[e] + (b[e] @ a[e]) * (ALPHA / RANK) for e in range(w.shape[0])])
            assert (want[i, name] - w).abs().max() > 1e-3
    merge_lora(model)
    for (i, name), value in want.items():
        torch.testing.assert_close(getattr(stacks[i], name), value.detach(), rtol=1e-6, atol=1e-6)
