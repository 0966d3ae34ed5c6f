"""Model families as plug-ins: Qwen3 and Qwen3-MoE against transformers' own classes, and the rule
that no code outside a family's folder branches on a family's name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, ModelConfig
from suite.export.hf import export_hf
from suite.infer.generate import generate_tokens
from suite.models import build_model, materialize
from suite.models.checks import check_model
from suite.models.family import FAMILIES
from suite.sources import load_hf_model

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
HF_MODELS = {
    # heads of their own size (12, not hidden / heads = 8), as Qwen3's 128-wide heads are
    "qwen3-tied": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=12, tie_word_embeddings=True, **SMALL)),
    "qwen3-untied": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, tie_word_embeddings=False, **SMALL)),
    # renormalised top-k weights; layer 1 dense by mlp_only_layers
    "qwen3-moe-norm-topk": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            head_dim=12,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            **SMALL,
        )
    ),
    # the softmax over all experts taken at the top k; every second layer MoE (decoder_sparse_step)
    "qwen3-moe-sparse-step": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            **{**SMALL, "num_hidden_layers": 4},
        )
    ),
}
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _randomise(model: torch.nn.Module) -> None:
    """Every tensor away from its initial value (q/k norms included), so a missed one cannot hide."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_qwen3_import_matches_transformers_logits_and_greedy_tokens(tmp_path, name):
    """Fails if the q/k norms are skipped or applied after RoPE, if head_dim is taken as hidden/heads,
    if norm_topk_prob=false still renormalises, or if a dense/MoE layer lands on the wrong index."""
    hf = HF_MODELS[name]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    assert ours.cfg.family == "qwen3"
    with torch.no_grad():
        expected = hf(TOKENS).logits
        got = ours(TOKENS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    prompt = TOKENS[0, :5].tolist()
    ids = torch.tensor([prompt])
    reference = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    greedy = GenerateConfig(temperature=0.0, max_new_tokens=10)
    assert generate_tokens(ours, prompt, greedy) == reference[0, 5:].tolist()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_export_loads_in_transformers_with_the_same_logits(tmp_path, moe):
    cfg = ModelConfig(
        family="qwen3",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        vocab_size=96,
        max_seq_len=64,
        ffn_hidden_size=80,
        tie_embeddings=not moe,
        num_experts=4 if moe else 0,
        top_k=2,
        moe_ffn_hidden_size=24,
        moe_layers=[0, 2] if moe else None,
        norm_topk_prob=False,
        norm_eps=1e-6,
    )
    model = materialize(build_model(cfg), "cpu", seed=3).eval()
    _randomise(model)
    export_hf(model, cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), atol=1e-4, rtol=1e-4)
    if moe:
        assert hf.config.mlp_only_layers == [1] and hf.config.norm_topk_prob is False


def test_qwen3_refuses_qkv_bias_in_one_line():
    with pytest.raises(ConfigError, match="Qwen3 has no qkv bias"):
        check_model(ModelConfig(family="qwen3", qkv_bias=True))


def test_an_unknown_family_names_the_registered_ones():
    with pytest.raises(ConfigError, match=r"model.family='gemma'.*gpt, llama, qwen3"):
        check_model(ModelConfig(family="gemma"))


def test_no_code_outside_a_family_folder_branches_on_a_family_name():
    """A family is its folder plus one registry line: comparisons of model.family or an HF
    model_type with a string anywhere else would make adding a family a change in many files."""
    found = subprocess.run(
        ["git", "grep", "-n", "-E", r"(family|model_type) *(==|!=| in \()", "--", "suite"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    folders = tuple(f"suite/models/{name}/" for name in FAMILIES)
    outside = [line for line in found if not line.startswith(folders)]
    assert outside == []
    assert re.search(r"from suite\.models import .*qwen3", (ROOT / "suite/models/__init__.py").read_text())
