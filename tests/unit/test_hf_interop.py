"""Exact conversion to and from transformers' own classes, on tiny random models they create."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, ModelConfig
from suite.export.hf import export_hf
from suite.infer.generate import generate_tokens
from suite.model_source import load_hf_model
from suite.models import build_model, materialize

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
HF_MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    ),
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **SMALL)),
    "llama3-rope-scaling": lambda: LlamaForCausalLM(
        LlamaConfig(
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            **SMALL,
        )
    ),
    "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(
        Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **SMALL)
    ),
    # heads of their own size (head_dim 12, not hidden / heads = 8): model.head_dim
    "qwen2-head-dim": lambda: Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, head_dim=12, **SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(num_key_value_heads=1, sliding_window=None, **SMALL)),
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **SMALL
        )
    ),
}
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _randomise(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases too, so a swapped or missed tensor cannot hide."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_import_matches_transformers_logits(tmp_path, name):
    torch.manual_seed(0)
    hf = HF_MODELS[name]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        got = ours(TOKENS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    greedy = GenerateConfig(temperature=0.0, max_new_tokens=10)
    prompt = TOKENS[0, :5].tolist()
    ids = torch.tensor([prompt])
    reference = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert generate_tokens(ours, prompt, greedy) == reference[0, 5:].tolist()


@pytest.mark.parametrize(
    "family",
    ["gpt", "llama", "llama-qkv-bias", "llama-moe", "llama-head-dim", "gpt-fused", "llama-qkv-bias-fused"],
)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family):
    fused = family.endswith("-fused")
    family = family.removesuffix("-fused")
    cfg = ModelConfig(
        family=family.split("-")[0],
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        vocab_size=96,
        max_seq_len=64,
        num_kv_heads=2 if family != "gpt" else None,
        qkv_bias=family.endswith("bias"),
        tie_embeddings=family == "gpt",
        ffn_hidden_size=80,
        num_experts=4 if family.endswith("moe") else 0,
        moe_ffn_hidden_size=48,
        fused_projections=fused,
        head_dim=12 if family.endswith("head-dim") else None,
    )
    model = materialize(build_model(cfg), "cpu", seed=3)
    _randomise(model)
    export_hf(model, cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), atol=1e-4, rtol=1e-4)
    expected_class = {
        "gpt": "GPT2LMHeadModel",
        "llama": "LlamaForCausalLM",
        "llama-qkv-bias": "Qwen2ForCausalLM",
        "llama-moe": "MixtralForCausalLM",
        "llama-head-dim": "LlamaForCausalLM",
    }
    assert type(hf).__name__ == expected_class[family]
    if family != "gpt":  # GPT-2's config derives it (n_embd / n_head)
        assert hf.config.head_dim == model.head_dim


def test_gpt_with_its_own_head_size_is_refused_by_export(tmp_path):
    """GPT-2's config derives the head size from n_embd / n_head: a GPT whose heads are another
    size (a pruned one) is refused before anything is written."""
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, head_dim=12, vocab_size=96, max_seq_len=64)
    model = materialize(build_model(cfg), "cpu", seed=0)
    with pytest.raises(
        ConfigError, match=r"model.head_dim=12 .*prune.hidden = prune.heads: hidden 24 for 2 heads of 12"
    ):
        export_hf(model, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["gpt2", "qwen2-qkv-bias", "mistral", "mixtral"])
def test_import_into_fused_projections_matches_transformers_logits(tmp_path, name):
    """HF weights converted into the fused layout (wqkv, w13) give transformers' logits."""
    import dataclasses

    from suite.model_source import read_hf_weights
    from suite.models.hf_mapping import from_hf_state_dict, model_config_from_hf

    torch.manual_seed(0)
    hf = HF_MODELS[name]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    cfg = dataclasses.replace(model_config_from_hf(tmp_path), fused_projections=True)
    ours = materialize(build_model(cfg), "cpu", seed=0).eval()
    ours.load_state_dict(from_hf_state_dict(cfg, read_hf_weights(tmp_path)), strict=not cfg.tie_embeddings)
    assert any(".wqkv." in k for k in ours.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_refused(tmp_path):
    from transformers import BertConfig

    BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'bert' model; importable architectures"):
        load_hf_model(tmp_path)


def test_mixtral_fused_and_per_expert_layouts_import_alike(tmp_path):
    """transformers 5 holds experts fused (gate_up_proj [E, 2*ffn, h]); its files list them per expert."""
    from suite.model_source import read_hf_weights
    from suite.models.hf_mapping import from_hf_state_dict, model_config_from_hf

    hf = HF_MODELS["mixtral"]()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    cfg = model_config_from_hf(tmp_path)
    from_files = from_hf_state_dict(cfg, read_hf_weights(tmp_path))
    from_memory = from_hf_state_dict(cfg, hf.state_dict())
    assert from_files.keys() == from_memory.keys()
    for name in from_files:
        torch.testing.assert_close(from_files[name], from_memory[name], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "llama-gqa-fused", "mixtral"])
def test_lazy_import_reads_only_the_requested_box(tmp_path, name):
    """The HF -> suite mapping run on unread tensors: any box of any suite tensor equals the eager
    conversion's, and reading a box reads only that many elements from the files (how each rank of
    a sharded run loads its own shard: suite.model_source)."""
    import dataclasses

    from suite.model_source import hf_weights, read_hf_weights
    from suite.models.hf_mapping import from_hf_state_dict, model_config_from_hf
    from suite.models.lazy import Source

    hf = HF_MODELS[name.removesuffix("-fused")]()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    cfg = model_config_from_hf(tmp_path)
    if name.endswith("-fused"):  # wqkv (kv-group layout) and w13 (interleaved gate/up rows)
        cfg = dataclasses.replace(cfg, fused_projections=True)
    eager = from_hf_state_dict(cfg, read_hf_weights(tmp_path))
    read_elements = []
    with hf_weights(tmp_path) as tensors:
        for source in tensors.values():
            inner = source.reader
            source.reader = lambda box, inner=inner: read_elements.append(inner(box).numel()) or inner(box)
        assert all(isinstance(t, Source) for t in tensors.values())
        lazy = from_hf_state_dict(cfg, tensors)
        assert lazy.keys() == eager.keys()
        for key, value in eager.items():
            # the second half of dim 0 (tensor parallel rows, FSDP shards), and of the last dim
            for dim in {0, value.dim() - 1}:
                box = [(0, n) for n in value.shape]
                box[dim] = (value.shape[dim] // 2, value.shape[dim])
                read_elements.clear()
                got = lazy[key].read(tuple(box))
                expected = value[tuple(slice(a, b) for a, b in box)]
                assert torch.equal(got, expected), (key, box)
                assert sum(read_elements) == expected.numel(), key
