"""DeepSeek-V3 on the Hugging Face side (DeepseekV3ForCausalLM).

Attention: q_a_proj / q_a_layernorm / q_b_proj (or q_proj), kv_a_proj_with_mqa / kv_a_layernorm /
kv_b_proj, o_proj. The first `first_k_dense_replace` layers have a dense MLP (intermediate_size);
the rest are MoE: the router mlp.gate (weight and e_score_correction_bias, the aux-free balancing
bias), the experts transformers 5's fused mlp.experts.gate_up_proj/down_proj (saved one expert at a
time, as DeepSeek's checkpoints are), and the shared experts mlp.shared_experts. Multi-token
prediction layers are not part of transformers' model (it ignores model.layers.<num_layers>).
"""

from __future__ import annotations

from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import ffn_size
from suite.models.lazy import as_lazy
from suite.models.llama.convert import (
    experts_from_hf,
    experts_to_hf,
    gguf_experts,
    gguf_name,
    layer_of,
    map_names,
    rope_fields_from_hf,
)
from suite.models.moe import expert_ffn_size, moe_layer_ids
from suite.models.qwen3.convert import on_disk_names  # experts one by one: the same layout

__all__ = ["on_disk_names"]


def check(cfg: ModelConfig) -> None:
    problems = []
    if not (cfg.kv_lora_rank > 0 and cfg.qk_rope_head_dim > 0 and cfg.v_head_dim > 0):
        problems.append("model.kv_lora_rank, model.qk_rope_head_dim and model.v_head_dim must be positive")
    if cfg.qk_rope_head_dim % 2:
        problems.append(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        problems.append("MLA has no grouped-query attention: model.num_kv_heads must be null")
    if cfg.qkv_bias:
        problems.append("model.qkv_bias must be false")
    if cfg.num_experts and cfg.router_groups > 1 and cfg.num_experts % cfg.router_groups:
        problems.append(
            f"model.router_groups={cfg.router_groups} must divide model.num_experts={cfg.num_experts}"
        )
    if problems:
        raise ConfigError(f"model.family=deepseek_v3: {'; '.join(problems)}")


def first_dense_layers(cfg: ModelConfig) -> int:
    """first_k_dense_replace: the MoE layers must be the last ones, from this index on."""
    moe = moe_layer_ids(cfg)
    first = moe[0] if moe else cfg.num_layers
    if moe != list(range(first, cfg.num_layers)):
        raise ConfigError(
            "export.format=hf writes DeepSeek-V3, whose MoE layers are all layers from first_k_dense_replace on; "
            f"model.moe_layers={moe} is not; use model.moe_layers=[{first}, ..., {cfg.num_layers - 1}]"
        )
    return first


def hf_config(cfg: ModelConfig, special: dict[str, Any]) -> Any:
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import DeepseekV3Config

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=ffn_size(cfg),
        moe_intermediate_size=expert_ffn_size(cfg) if cfg.num_experts else 1,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=max(cfg.num_experts, 1),
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.router_groups,
        topk_group=cfg.router_topk_groups,
        num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=first_dense_layers(cfg),
        norm_topk_prob=cfg.norm_topk_prob,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        rope_interleave=True,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        hidden_act="silu",
        **special,
    )


def config_from_hf(hf: Any, where: str) -> dict[str, Any]:
    if getattr(hf, "attention_bias", False):
        raise ConfigError(f"{where}: DeepSeek-V3 with attention_bias is not supported")
    if not getattr(hf, "rope_interleave", True):
        raise ConfigError(f"{where}: DeepSeek-V3 with rope_interleave=false is not supported")
    layers = hf.num_hidden_layers
    first_dense = min(hf.first_k_dense_replace, layers)
    moe = dict(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_layers=list(range(first_dense, layers)),
        num_shared_experts=hf.n_shared_experts or 0,
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_score="sigmoid",
        router_groups=hf.n_group or 1,
        router_topk_groups=hf.topk_group or 1,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    return dict(
        num_layers=layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings),
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        **rope_fields_from_hf(hf),
        **(moe if first_dense < layers else {}),
    )


def names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(suite name, HF name) of every tensor but the stacked experts."""
    out = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ]
    attention = {
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_a_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
    }
    if cfg.q_lora_rank:
        attention |= {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj"}
    else:
        attention["wq"] = "q_proj"
    mlp = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    moe_layers = moe_layer_ids(cfg)
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += [
            (p + "attention_norm.weight", q + "input_layernorm.weight"),
            (p + "ffn_norm.weight", q + "post_attention_layernorm.weight"),
        ]
        out += [
            (f"{p}attention.{ours}.weight", f"{q}self_attn.{theirs}.weight")
            for ours, theirs in attention.items()
        ]
        if i not in moe_layers:
            out += [
                (f"{p}feed_forward.{ours}.weight", f"{q}mlp.{theirs}.weight") for ours, theirs in mlp.items()
            ]
            continue
        out += [
            (p + "feed_forward.router.weight", q + "mlp.gate.weight"),
            (p + "feed_forward.expert_bias", q + "mlp.gate.e_score_correction_bias"),
        ]
        if cfg.num_shared_experts:
            out += [
                (f"{p}feed_forward.shared_experts.{ours}.weight", f"{q}mlp.shared_experts.{theirs}.weight")
                for ours, theirs in mlp.items()
            ]
    return out


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {theirs: sd[ours] for ours, theirs in names(cfg)}
    experts_to_hf(cfg, sd, out)
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    map_names(names(cfg), hf_sd, sd)
    experts_from_hf(cfg, hf_sd, sd)
    return sd


def gguf_problem(cfg: ModelConfig) -> str | None:
    """What llama.cpp's deepseek2 cannot hold: it needs MoE layers, and they always add shared experts."""
    if cfg.rope_scaling:
        return (
            "model.rope_scaling (YaRN) is not written to deepseek2's keys here; use model.rope_scaling=null"
        )
    if not cfg.num_experts:
        return "llama.cpp's deepseek2 reads the expert keys of MoE layers, and this model has none; use format=hf"
    if not cfg.num_shared_experts:
        return "llama.cpp's deepseek2 adds shared experts in every MoE layer; model.num_shared_experts=0 is not that"
    first_dense_layers(cfg)  # MoE layers from first_k_dense_replace on, or one line saying which
    return None


def gguf_hparams(writer: Any, cfg: ModelConfig) -> None:
    """deepseek2's keys. MLA is stored the way llama.cpp runs it, as one shared latent head (head_count_kv
    1, key_length kv_lora_rank + rope, value_length kv_lora_rank), with the per-head sizes of the
    expanded keys and values in key_length_mla / value_length_mla; RoPE covers qk_rope_head_dim in
    DeepSeek's interleaved pairs (llama.cpp's normal RoPE), so nothing is permuted."""
    # deferred: gguf is optional (the deploy extra); only format=gguf needs it
    import gguf

    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_leading_dense_block_count(first_dense_layers(cfg))
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_feed_forward_length(expert_ffn_size(cfg))
    writer.add_expert_shared_count(cfg.num_shared_experts)
    writer.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    gating = (
        gguf.ExpertGatingFuncType.SIGMOID
        if cfg.router_score == "sigmoid"
        else gguf.ExpertGatingFuncType.SOFTMAX
    )
    writer.add_expert_gating_func(gating)
    if cfg.router_groups > 1:
        writer.add_expert_group_count(cfg.router_groups)
        writer.add_expert_group_used_count(cfg.router_topk_groups)


def gguf_tensors(cfg: ModelConfig, hf_name: str, value: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors deepseek2 stores otherwise than HF: the stacked experts (ffn_*_exps), the balancing
    bias (exp_probs_b), and MLA's kv_b_proj split per head into k_b, transposed so the query is
    absorbed into the latent ([heads, kv_lora_rank, nope]), and v_b ([heads, v_head_dim, kv_lora_rank])."""
    experts = gguf_experts(hf_name, value)
    if experts is not None:
        return experts
    if hf_name.endswith(".mlp.gate.e_score_correction_bias"):
        return [(gguf_name("FFN_EXP_PROBS_B", layer_of(hf_name), ".bias"), as_lazy(value).read())]
    if hf_name.endswith(".self_attn.kv_b_proj.weight"):
        per_head = as_lazy(value).read().reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        k_b, v_b = per_head.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        layer = layer_of(hf_name)
        return [(gguf_name("ATTN_K_B", layer), k_b.transpose(1, 2)), (gguf_name("ATTN_V_B", layer), v_b)]
    return None


def gguf_unreadable(arch: str) -> str | None:
    """The export's logits self-check reads through transformers, which has no deepseek2."""
    return "transformers' GGUF reader has no deepseek2 architecture (llama.cpp reads the file)"


def gguf_import_problem(arch: str) -> str | None:
    """`ckpt=gguf:` reads the config through transformers too."""
    return f"{gguf_unreadable(arch)}; import the Hugging Face folder (hf:<folder>)"
