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
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, ModelConfig
from suite.export.hf import export_hf
from suite.infer.generate import generate_tokens
from suite.model_source import load_hf_model
from suite.models import build_model, materialize
from suite.models.checks import check_model
from suite.models.family import FAMILIES

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
DEEPSEEK = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=12,
    qk_rope_head_dim=4,
    v_head_dim=6,
    qk_nope_head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
HF_MODELS |= {
    # MLA with a query bottleneck; sigmoid routing over 4 groups keeping 2, a shared expert, layer 0 dense
    "deepseek-v3": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(
            q_lora_rank=16,
            n_shared_experts=1,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            **DEEPSEEK,
        )
    ),
    # one query projection (V2-Lite's layout), plain top-k without renormalising, no shared expert
    "deepseek-v3-no-q-lora": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(
            q_lora_rank=None,
            n_shared_experts=0,
            n_routed_experts=6,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=2,
            **DEEPSEEK,
        )
    ),
}
# the suite's side of DEEPSEEK: MLA at the same tiny widths
SUITE_MLA = dict(
    family="deepseek_v3",
    hidden_size=32,
    num_heads=4,
    vocab_size=96,
    max_seq_len=64,
    ffn_hidden_size=48,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _randomise(model: torch.nn.Module) -> None:
    """Every tensor away from its initial value (q/k norms included), so a missed one cannot hide."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        for name, b in model.named_buffers():  # DeepSeek's aux-free balancing bias decides the routing
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_import_matches_transformers_logits_and_greedy_tokens(tmp_path, name):
    """Qwen3: fails if the q/k norms are skipped or applied after RoPE, if head_dim is taken as
    hidden/heads, if norm_topk_prob=false still renormalises, or if a dense/MoE layer lands on the
    wrong index. DeepSeek-V3: fails if RoPE is not interleaved or rotates the wrong dims, if the
    latent norm, the group mask, the expert bias (choice only), routed_scaling_factor or the shared
    expert is wrong; the greedy tokens decode through MLA's latent cache."""
    hf = HF_MODELS[name]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    assert ours.cfg.family == name.split("-")[0].replace("deepseek", "deepseek_v3")
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


def test_deepseek_export_loads_in_transformers_with_the_same_logits(tmp_path):
    cfg = ModelConfig(
        family="deepseek_v3",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        vocab_size=96,
        max_seq_len=64,
        ffn_hidden_size=48,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        num_experts=8,
        top_k=2,
        moe_layers=[1, 2],
        moe_ffn_hidden_size=16,
        num_shared_experts=2,
        router_score="sigmoid",
        router_groups=4,
        router_topk_groups=2,
        routed_scaling_factor=2.5,
        tie_embeddings=False,
        norm_eps=1e-6,
    )
    model = materialize(build_model(cfg), "cpu", seed=3).eval()
    _randomise(model)
    export_hf(model, cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and hf.config.first_k_dense_replace == 1
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), atol=1e-4, rtol=1e-4)


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
    with pytest.raises(ConfigError, match=r"model.family='gemma'.*deepseek_v3, gpt, llama, qwen3"):
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


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "recipes/model").glob("*.yaml")))
def test_the_planner_counts_every_presets_parameters_as_built(preset):
    """suite plan's counts (suite/plan/params.py) against the model the trainer builds, on meta."""
    import yaml

    from suite.plan.params import count_params

    cfg = ModelConfig(**yaml.safe_load((ROOT / f"recipes/model/{preset}.yaml").read_text()))
    with torch.device("meta"):
        model = build_model(cfg)
    built = sum(p.numel() for p in model.parameters())  # a tied head once; positions included
    assert count_params(cfg) == built


def test_deepseek_v3_671b_has_its_published_size():
    """671B total (published: 671B, within 0.5%); activated per token 36.63B without the embedding
    lookup (a row read, no compute), 37.55B with it. The published "37B" is rounded to two digits,
    so what can be checked is that the count rounds to it (36.5-37.5B): 0.5% of a rounded figure
    is below its rounding. Fails if a block's shapes change (e.g. kv_b sized for all heads' full
    key dims, or the shared expert left out)."""
    import yaml

    from suite.plan.params import count_params, model_specs

    cfg = ModelConfig(**yaml.safe_load((ROOT / "recipes/model/deepseek-v3-671b.yaml").read_text()))
    total = count_params(cfg)
    experts = sum(s.numel for s in model_specs(cfg) if s.expert)
    activated = total - experts + experts * cfg.top_k / cfg.num_experts
    lookup = cfg.vocab_size * cfg.hidden_size  # the input embedding (the head is untied)
    assert abs(total / 671e9 - 1) < 0.005, total
    assert 36.5e9 <= activated - lookup < 37.5e9, activated - lookup
    assert abs((activated - lookup) / 36.63e9 - 1) < 0.001, activated - lookup


def test_mla_batch_decoding_from_its_latent_cache_matches_one_prompt_at_a_time(tmp_path):
    """`suite generate`'s batch decoder (suite/infer/decoder.py: left-padded rows, a static cache of
    MLA's latent and shared RoPE key) gives each row the greedy tokens of decoding it alone (which
    the import test checks against transformers). Fails if the cache holds the wrong dims or the
    padding mask misses the latent cache."""
    from suite.infer.decoder import BatchDecoder

    hf = HF_MODELS["deepseek-v3"]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    prompts = [TOKENS[0, :7].tolist(), TOKENS[1, :3].tolist()]
    greedy = GenerateConfig(temperature=0.0, max_new_tokens=6)
    alone = [generate_tokens(ours, p, greedy) for p in prompts]
    steps = list(BatchDecoder(ours).generate(prompts, 6, lambda logits: logits.argmax(-1, keepdim=True)))
    assert torch.stack(steps, dim=1).tolist() == alone


MOE_MODELS = ["qwen3-moe-norm-topk", "qwen3-moe-sparse-step", "deepseek-v3", "deepseek-v3-no-q-lora"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_the_dense_moe_form_gives_the_routed_logits(tmp_path, name):
    """MoE layers in the form the graph exports trace (suite.infer.graphs.traceable_moe: every expert
    on every token, weighted by the router's choice, zero elsewhere) give the sparsely routed model's
    logits, for softmax and sigmoid-grouped routing, renormalised or not, with and without shared
    experts. Fails if the dense form drops the routed scaling, the shared experts, the
    renormalisation or the balancing bias's choice, or if it stays on after the export."""
    from suite.infer.graphs import traceable_moe
    from suite.models.moe import moe_modules

    hf = HF_MODELS[name]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    ours.eval()
    with torch.no_grad():
        routed = ours(TOKENS)
        with traceable_moe(ours):
            dense = ours(TOKENS)
    assert not any(m.dense for m in moe_modules(ours))
    torch.testing.assert_close(dense, routed, atol=1e-5, rtol=1e-5)


def test_a_mixture_of_experts_exports_as_a_torch_program_with_the_routed_logits(tmp_path):
    """The torch.export programs of DeepSeek-V3 (MLA's latent cache, sigmoid-grouped routing, a shared
    expert) reproduce the routed model within 1e-4 (fp32) for the prefill and 3 decode steps through
    the cache. Fails if the export refuses MoE again or traces the data-dependent dispatch (it cannot).
    ONNX goes through the same traced form: run once in docs/export.md (it costs ~45 s here)."""
    from suite.export.programs import save_torch_export
    from suite.infer.runners import ProgramRunner, SuiteRunner, decode_steps

    hf = HF_MODELS["deepseek-v3"]().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours, _ = load_hf_model(tmp_path / "hf")
    save_torch_export(ours, tmp_path)
    want = decode_steps(SuiteRunner(ours), TOKENS[:, :9], 3)
    got = decode_steps(ProgramRunner(tmp_path, 64), TOKENS[:, :9], 3)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_mtp_modules_train_only_and_are_dropped_on_export(tmp_path):
    """In training the forward leaves the weighted MTP loss for the step (about 0.3 x ln(vocab) at a
    fresh init); in evaluation it computes none; the HF export holds no MTP tensor and transformers
    loads it with the main model's logits. Fails if MTP leaks into the exported weights or runs
    outside training."""
    from safetensors.torch import load_file

    cfg = ModelConfig(
        **SUITE_MLA,
        num_layers=2,
        num_mtp_layers=1,
        tie_embeddings=False,
    )
    model = materialize(build_model(cfg), "cpu", seed=3)
    model.train()
    model(TOKENS)
    assert model.mtp_loss is not None and 0.2 < float(model.mtp_loss) / torch.log(torch.tensor(96.0)) < 0.4
    model.eval()
    model.mtp_loss = None
    model(TOKENS)
    assert model.mtp_loss is None
    export_hf(model, cfg, tmp_path)
    assert not [k for k in load_file(tmp_path / "model.safetensors") if "mtp" in k or "layers.2." in k]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), atol=1e-4, rtol=1e-4)


def test_mtp_loss_over_whole_rows_equals_the_cut_rows():
    """suite.models.mtp runs every depth over the whole row and leaves the positions past its end out
    of the loss (so the layouts that split the sequence can); equal, with two depths, to the
    definition: depth k on the row cut to positions 0 .. s-k-1, embedding token i+k, predicting
    i+k+1. Fails on a shift off by one, a padded position counted in the mean, or a depth that
    gets the wrong hidden state."""
    import torch.nn.functional as F

    from suite.models.mtp import mtp_loss

    cfg = ModelConfig(
        **SUITE_MLA,
        num_layers=1,
        num_mtp_layers=2,
    )
    model = materialize(build_model(cfg), "cpu", seed=5)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    rope = model.rope_tables(torch.arange(12), hidden.dtype)
    got = mtp_loss(model, tokens, hidden, rope)
    seq, h, losses = 12, hidden, []
    for k, module in enumerate(model.mtp.values(), start=1):
        h = module(
            h[:, : seq - k],
            model.tok_embeddings(tokens[:, k:]),
            model.rope_tables(torch.arange(seq - k), h.dtype),
        )
        logits = model.output(module.norm(h[:, :-1])).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 :].flatten()))
    torch.testing.assert_close(got, sum(losses) / 2, atol=1e-6, rtol=1e-6)


def test_deepseek_latent_norms_keep_their_own_eps_as_transformers_does(tmp_path):
    """transformers' DeepseekV3Attention (and V2's, and DeepSeek's own modeling code) builds
    q_a_layernorm / kv_a_layernorm with RMSNorm's default eps 1e-6, whatever config.rms_norm_eps
    says; the config has no key for them. With rms_norm_eps = 0.5 (large enough to show) the import
    still matches transformers' logits within 1e-4. Fails if the latent norms take the config's eps."""
    hf = DeepseekV3ForCausalLM(
        DeepseekV3Config(
            q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, **{**DEEPSEEK, "rms_norm_eps": 0.5}
        )
    ).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf_model(tmp_path)
    assert ours.cfg.norm_eps == 0.5
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=1e-4)
