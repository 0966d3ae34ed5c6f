"""The Llama layout on the Hugging Face side (LlamaForCausalLM; Qwen2ForCausalLM when the run uses
qkv bias; MixtralForCausalLM for MoE) and llama.cpp's llama architecture.

Mistral and Qwen2 checkpoints import into the llama family too. model.head_dim is the HF config's
head_dim (written always, read when it differs from hidden / heads). MoE: router = mlp.gate; the
stacked experts w1/w3 [E, ffn, h] are transformers 5's fused mlp.experts.gate_up_proj (cat on dim 1),
w2 its down_proj; folders saved per expert (block_sparse_moe.experts.N.w1/w2/w3) import too.
The decoder names here (`decoder_names`, `experts_to_hf`, `experts_from_hf`) are the Llama layout's,
which families built on it (qwen3) extend.
"""

from __future__ import annotations

from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import ffn_size, head_size, kv_heads
from suite.models.lazy import as_lazy
from suite.models.moe import expert_ffn_size, moe_layer_ids


def default_ffn(cfg: ModelConfig) -> int:
    """Llama's 2/3 * 4h, rounded up to a multiple of 256."""
    width = int(2 * 4 * cfg.hidden_size / 3)
    return 256 * ((width + 255) // 256)


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling:
        return {**dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}


def common_hf_fields(cfg: ModelConfig, special: dict[str, Any]) -> dict[str, Any]:
    """The config fields every Llama-layout transformers class shares."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=ffn_size(cfg),
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=kv_heads(cfg),
        head_dim=head_size(cfg),
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        **special,
    )


def hf_config(cfg: ModelConfig, special: dict[str, Any]) -> Any:
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import LlamaConfig, Qwen2Config

    common = common_hf_fields(cfg, special)
    if cfg.num_experts:
        return _mixtral_config(cfg, common)
    if cfg.qkv_bias:
        return Qwen2Config(**common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _mixtral_config(cfg: ModelConfig, common: dict) -> Any:
    """MixtralConfig for a llama-family MoE; refuses what Mixtral cannot express."""
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import MixtralConfig

    problems = []
    if cfg.qkv_bias:
        problems.append("a llama-family model without qkv bias")
    if moe_layer_ids(cfg) != list(range(cfg.num_layers)):
        problems.append("every layer MoE (model.moe_every=1)")
    if cfg.num_shared_experts:
        problems.append("no shared experts (model.num_shared_experts=0)")
    if problems:
        raise ConfigError(
            f"export.format=hf writes MoE models as Mixtral, which needs {' and '.join(problems)}"
        )
    return MixtralConfig(
        **{**common, "intermediate_size": expert_ffn_size(cfg)},
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.aux_loss_coef,
        sliding_window=None,
    )


def rope_fields_from_hf(hf: Any) -> dict[str, Any]:
    """rope_theta and rope_scaling from a transformers 5 config's rope_parameters."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def common_fields_from_hf(hf: Any) -> dict[str, Any]:
    """The suite fields every Llama-layout transformers config gives."""
    head_dim = getattr(hf, "head_dim", None)
    if head_dim == hf.hidden_size // hf.num_attention_heads and not hf.hidden_size % hf.num_attention_heads:
        head_dim = None  # the default: hidden_size / heads
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings),
        **rope_fields_from_hf(hf),
    )


def config_from_hf(hf: Any, where: str) -> dict[str, Any]:
    if hf.model_type == "llama" and getattr(hf, "attention_bias", False):
        raise ConfigError(f"{where}: Llama with attention_bias (bias on o_proj too) is not supported")
    fields = common_fields_from_hf(hf)
    fields["qkv_bias"] = hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
    if getattr(hf, "num_local_experts", None):  # Mixtral
        fields |= dict(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size,
            aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.01)),
        )
    return fields


def decoder_names(
    cfg: ModelConfig, attention_extra: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    """(suite name, HF name) of every tensor but the stacked experts; `attention_extra` adds per-layer
    attention modules (ours, theirs), e.g. Qwen3's q/k norms."""
    names = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ]
    proj = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    mlp = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        names += [
            (p + "attention_norm.weight", q + "input_layernorm.weight"),
            (p + "ffn_norm.weight", q + "post_attention_layernorm.weight"),
        ]
        for ours, theirs in proj.items():
            names.append((f"{p}attention.{ours}.weight", f"{q}self_attn.{theirs}.weight"))
            if cfg.qkv_bias and ours != "wo":
                names.append((f"{p}attention.{ours}.bias", f"{q}self_attn.{theirs}.bias"))
        for ours, theirs in attention_extra:
            names.append((f"{p}attention.{ours}.weight", f"{q}self_attn.{theirs}.weight"))
        if i in moe_layer_ids(cfg):  # experts are stacked tensors: experts_to_hf / experts_from_hf
            names.append((p + "feed_forward.router.weight", q + "mlp.gate.weight"))
            continue
        for ours, theirs in mlp.items():
            names.append((f"{p}feed_forward.{ours}.weight", f"{q}mlp.{theirs}.weight"))
    return names


def experts_to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """Stacked experts as transformers 5's fused gate_up_proj [E, 2 ffn, h] and down_proj [E, h, ffn]."""
    for i in moe_layer_ids(cfg):
        p, q = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
        out[q + "gate_up_proj"] = torch.cat([sd[p + "w1"], sd[p + "w3"]], dim=1)
        out[q + "down_proj"] = sd[p + "w2"]


def experts_from_hf(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> None:
    """The inverse of experts_to_hf; also reads folders saved one expert at a time (N.w1/w2/w3 or
    N.gate_proj/up_proj/down_proj)."""
    per_expert = {"w1": ("w1", "gate_proj"), "w2": ("w2", "down_proj"), "w3": ("w3", "up_proj")}
    for i in moe_layer_ids(cfg):
        p, q = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
        if q + "gate_up_proj" in hf_sd:
            sd[p + "w1"], sd[p + "w3"] = hf_sd[q + "gate_up_proj"].chunk(2, dim=1)
            sd[p + "w2"] = hf_sd[q + "down_proj"]
            continue
        for ours, spellings in per_expert.items():
            theirs = next(s for s in spellings if f"{q}0.{s}.weight" in hf_sd)
            sd[p + ours] = torch.stack([hf_sd[f"{q}{e}.{theirs}.weight"] for e in range(cfg.num_experts)])


def map_names(
    names: list[tuple[str, str]], hf_sd: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]
) -> None:
    """HF -> suite by a name list; a tied head saved once is read from the embedding."""
    for ours, theirs in names:
        if theirs == "lm_head.weight" and theirs not in hf_sd:
            sd[ours] = hf_sd["model.embed_tokens.weight"]
        else:
            sd[ours] = hf_sd[theirs]


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {theirs: sd[ours] for ours, theirs in decoder_names(cfg)}
    experts_to_hf(cfg, sd, out)
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Mixtral folders name the MoE block block_sparse_moe (per-expert files) or mlp (fused)
    hf_sd = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in hf_sd.items()}
    sd: dict[str, torch.Tensor] = {}
    map_names(decoder_names(cfg), hf_sd, sd)
    experts_from_hf(cfg, hf_sd, sd)
    return sd


def experts_one_by_one(hf_sd: dict, block: str, gate: str, up: str, down: str) -> dict:
    """transformers 5's fused experts (mlp.experts.gate_up_proj / down_proj) as one tensor per expert,
    `<layer>.<block>.experts.<e>.<gate|up|down>.weight`, and the router under `<block>.gate`: the names
    checkpoints on disk use (Mixtral: block_sparse_moe, w1/w3/w2; Qwen and DeepSeek: mlp, *_proj)."""
    out = {}
    for name, value in hf_sd.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.replace(".mlp.experts.gate_up_proj", f".{block}.experts.")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.{gate}.weight"], out[f"{prefix}{e}.{up}.weight"] = value.select(0, e).chunk(
                    2
                )
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.replace(".mlp.experts.down_proj", f".{block}.experts.")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.{down}.weight"] = value.select(0, e)
        else:
            out[name.replace(".mlp.gate.", f".{block}.gate.")] = value
    return out


def on_disk_names(cfg: ModelConfig, hf_sd: dict) -> dict:
    """The names transformers' save_pretrained writes: Mixtral experts one by one
    (block_sparse_moe.experts.N.w1/w2/w3), as older transformers and other tools read them."""
    return experts_one_by_one(hf_sd, "block_sparse_moe", "w1", "w3", "w2") if cfg.num_experts else hf_sd


def gguf_name(tensor: str, layer: int, suffix: str = ".weight") -> str:
    """llama.cpp's name of one layer's tensor (`gguf.MODEL_TENSOR` member name, e.g. FFN_GATE_EXP)."""
    # deferred: gguf is optional (the deploy extra); only format=gguf needs it
    import gguf

    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[tensor]].format(bid=layer) + suffix


def layer_of(hf_name: str) -> int:
    """The layer index of `model.layers.<i>.<...>`."""
    return int(hf_name.split(".")[2])


def gguf_experts(hf_name: str, value: Any) -> list[tuple[str, torch.Tensor]] | None:
    """Stacked experts as llama.cpp stores them: transformers 5's fused gate_up_proj [E, 2 ffn, h]
    split into ffn_gate_exps and ffn_up_exps [E, ffn, h], down_proj [E, h, ffn] as ffn_down_exps
    (GGUF lists the dims innermost first: {h, ffn, E}, as llama.cpp's loader asks)."""
    if hf_name.endswith(".mlp.experts.gate_up_proj"):
        gate, up = as_lazy(value).read().chunk(2, dim=1)
        return [
            (gguf_name("FFN_GATE_EXP", layer_of(hf_name)), gate),
            (gguf_name("FFN_UP_EXP", layer_of(hf_name)), up),
        ]
    if hf_name.endswith(".mlp.experts.down_proj"):
        return [(gguf_name("FFN_DOWN_EXP", layer_of(hf_name)), as_lazy(value).read())]
    return None


def gguf_problem(cfg: ModelConfig) -> str | None:
    if cfg.num_experts:
        return "a mixture of experts is not read back by transformers' GGUF loader for llama"
    if cfg.qkv_bias:
        return (
            "model.qkv_bias=true is GGUF's qwen2 architecture, which transformers' GGUF reader does not "
            "rebuild faithfully"
        )
    if cfg.rope_scaling:
        return "model.rope_scaling is not read back by transformers' GGUF loader for llama"
    return None


def gguf_hparams(writer: Any, cfg: ModelConfig) -> None:
    """RoPE and RMSNorm keys, and the head size where it is not hidden / heads."""
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(head_size(cfg))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if head_size(cfg) * cfg.num_heads != cfg.hidden_size:
        writer.add_key_length(head_size(cfg))
        writer.add_value_length(head_size(cfg))
