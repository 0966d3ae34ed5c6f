"""Qwen3 and Qwen3-MoE on the Hugging Face side (Qwen3ForCausalLM, Qwen3MoeForCausalLM) and
llama.cpp's qwen3 / qwen3moe architectures.

The Llama layout (suite.models.llama.convert) plus per-head q/k RMSNorms (self_attn.q_norm/k_norm).
MoE: the router is mlp.gate, the experts transformers 5's fused mlp.experts.gate_up_proj/down_proj,
saved one expert at a time (mlp.experts.N.gate_proj/up_proj/down_proj) as Qwen's own checkpoints
are; dense layers among MoE ones (mlp_only_layers, decoder_sparse_step) use intermediate_size.
"""

from __future__ import annotations

from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import head_size
from suite.models.llama.convert import (
    common_fields_from_hf,
    common_hf_fields,
    decoder_names,
    experts_from_hf,
    experts_one_by_one,
    experts_to_hf,
    gguf_experts,
    map_names,
)
from suite.models.moe import expert_ffn_size, moe_layer_ids

QK_NORMS = (("q_norm", "q_norm"), ("k_norm", "k_norm"))


def check(cfg: ModelConfig) -> None:
    if cfg.qkv_bias:
        raise ConfigError(
            "model.qkv_bias=true: Qwen3 has no qkv bias (its q/k norms replace it); use model.family=llama "
            "for Qwen2's qkv bias"
        )


def default_ffn(cfg: ModelConfig) -> int:
    """Qwen3's dense MLPs are 3x the width (0.6B: 1024 -> 3072; 8B: 4096 -> 12288)."""
    return 3 * cfg.hidden_size


def hf_config(cfg: ModelConfig, special: dict[str, Any]) -> Any:
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = common_hf_fields(cfg, special)
    if not cfg.num_experts:
        return Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
    moe = moe_layer_ids(cfg)
    sparse_step = next(
        (s for s in range(1, cfg.num_layers + 1) if moe == _sparse_layers(cfg.num_layers, s)), 1
    )
    dense = [i for i in _sparse_layers(cfg.num_layers, sparse_step) if i not in moe]
    if cfg.num_shared_experts or [i for i in moe if i not in _sparse_layers(cfg.num_layers, sparse_step)]:
        raise ConfigError(
            "export.format=hf writes this MoE as Qwen3-MoE, which has no shared experts and places MoE layers "
            "by decoder_sparse_step and mlp_only_layers; use model.num_shared_experts=0"
        )
    return Qwen3MoeConfig(
        **common,
        attention_bias=False,
        use_sliding_window=False,
        moe_intermediate_size=expert_ffn_size(cfg),
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=dense,
        router_aux_loss_coef=cfg.aux_loss_coef,
    )


def _sparse_layers(num_layers: int, step: int) -> list[int]:
    return [i for i in range(num_layers) if (i + 1) % step == 0]


def config_from_hf(hf: Any, where: str) -> dict[str, Any]:
    if getattr(hf, "attention_bias", False):
        raise ConfigError(f"{where}: Qwen3 with attention_bias (bias on o_proj too) is not supported")
    if getattr(hf, "use_sliding_window", False):
        raise ConfigError(f"{where}: Qwen3 with use_sliding_window=true is not supported; set it false")
    fields = common_fields_from_hf(hf)
    if hf.model_type == "qwen3_moe" and hf.num_experts:
        dense = set(hf.mlp_only_layers or [])
        moe = [i for i in _sparse_layers(hf.num_hidden_layers, hf.decoder_sparse_step) if i not in dense]
        fields |= dict(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_layers=moe,
            norm_topk_prob=bool(hf.norm_topk_prob),
            aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.001)),
        )
    return fields


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {theirs: sd[ours] for ours, theirs in decoder_names(cfg, QK_NORMS)}
    experts_to_hf(cfg, sd, out)
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    map_names(decoder_names(cfg, QK_NORMS), hf_sd, sd)
    experts_from_hf(cfg, hf_sd, sd)
    return sd


def on_disk_names(cfg: ModelConfig, hf_sd: dict) -> dict:
    """Experts one by one (mlp.experts.N.gate_proj/up_proj/down_proj), as Qwen's checkpoints are."""
    return experts_one_by_one(hf_sd, "mlp", "gate_proj", "up_proj", "down_proj")


def gguf_arch(cfg: ModelConfig) -> str:
    """llama.cpp's qwen3 (dense) or qwen3moe (experts in every layer)."""
    return "qwen3moe" if cfg.num_experts else "qwen3"


def gguf_problem(cfg: ModelConfig) -> str | None:
    if cfg.rope_scaling:
        return "model.rope_scaling is not read back by transformers' GGUF loader for qwen3"
    if not cfg.num_experts:
        return None
    if moe_layer_ids(cfg) != list(range(cfg.num_layers)):
        return (
            f"llama.cpp's qwen3moe has experts in every layer; model.moe_layers={moe_layer_ids(cfg)} is not "
            "(mlp_only_layers / decoder_sparse_step); use model.moe_layers=null"
        )
    if not cfg.norm_topk_prob:
        return "llama.cpp's qwen3moe renormalises the top-k weights; model.norm_topk_prob=false is not that"
    if cfg.num_shared_experts:
        return "llama.cpp's qwen3moe has no shared experts; use model.num_shared_experts=0"
    return None


def gguf_hparams(writer: Any, cfg: ModelConfig) -> None:
    """Qwen3's keys: RoPE (NeoX order, so q/k are stored unpermuted), RMSNorm, the head size always;
    Qwen3-MoE's expert count, top-k and expert width (llama.cpp's qwen3moe renormalises the top k)."""
    writer.add_rope_dimension_count(head_size(cfg))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_key_length(head_size(cfg))
    writer.add_value_length(head_size(cfg))
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k)
        writer.add_expert_feed_forward_length(expert_ffn_size(cfg))


def gguf_tensors(cfg: ModelConfig, hf_name: str, value: Any) -> list[tuple[str, torch.Tensor]] | None:
    """Qwen3-MoE's stacked experts as ffn_{gate,up,down}_exps; every other tensor by gguf's name map."""
    return gguf_experts(hf_name, value)


def gguf_import_problem(arch: str) -> str | None:
    """`ckpt=gguf:` maps tensors one to one; qwen3moe's stacked experts are not read back here."""
    if arch == "qwen3moe":
        return "its qwen3moe experts (ffn_*_exps) are not read back here; import the Hugging Face folder (hf:<folder>)"
    return None


def gguf_load_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' GGUF mapping for qwen3 does not read the head size (key_length): it builds
    Qwen3Config's default 128-wide heads unless head_dim is passed (nor, for qwen3moe, the expert width
    or the renormalised top k: Qwen3MoeConfig's defaults are 768 and false). llama.cpp reads the keys."""
    if not cfg.num_experts:
        return {"head_dim": head_size(cfg)}
    return {"head_dim": head_size(cfg), "moe_intermediate_size": expert_ffn_size(cfg), "norm_topk_prob": True}


def gguf_config_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """Importing a Qwen3 GGUF: its head size (key_length; see gguf_load_kwargs)."""
    size = fields.get("attention.key_length")
    return {"head_dim": int(size)} if size else {}
