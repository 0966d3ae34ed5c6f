"""Exact weight and config mapping between suite models and Hugging Face transformers classes.

gpt family   <-> GPT2LMHeadModel (Conv1D weights are [in, out]: transposed; q/k/v fused as c_attn)
llama family <-> LlamaForCausalLM (Qwen2ForCausalLM when the run uses qkv bias); Mistral and
                 Qwen2 checkpoints import into the llama family too. model.head_dim is the HF
                 config's head_dim (written always, read when it differs from hidden / heads).
                 GPT-2's config has no head size of its own: a GPT model whose head_dim is not
                 hidden / heads (a pruned one) is refused (suite.export.checks.check_hf_exportable).
llama MoE    <-> MixtralForCausalLM: router = mlp.gate; our stacked experts w1/w3 [E, ffn, h] are
                 transformers 5's fused mlp.experts.gate_up_proj (cat on dim 1), w2 its down_proj;
                 folders saved per expert (block_sparse_moe.experts.N.w1/w2/w3) import too.
Config objects come from transformers' own config classes, never written by hand.
A model with fused projections (model.fused_projections: wqkv, w13) is converted through the
unfused names (suite.models.transformer.unfuse_state_dict / fuse_state_dict).

Pure functions of a config and a dict of tensors: they run unchanged on lazy tensors
(suite.models.lazy), which is how import and export read one tensor, or one shard, at a time.
Reading and writing files is suite.sources (import) and suite.export.hf (export).
"""

from __future__ import annotations

from pathlib import Path

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.moe import expert_ffn_size, moe_layer_ids
from suite.models.transformer import ffn_size, fuse_state_dict, head_size, kv_heads, unfuse_state_dict

LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
SUPPORTED = ("gpt2", *LLAMA_LIKE)


# ---- suite -> HF -------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, eos_id: int | None = None, pad_id: int | None = None):
    """The transformers config object that describes the same architecture."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    special = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    if cfg.family == "gpt":
        return GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=ffn_size(cfg),
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=cfg.tie_embeddings,
            **special,
        )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=ffn_size(cfg),
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=kv_heads(cfg),
        head_dim=head_size(cfg),
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        **special,
    )
    if cfg.num_experts:
        return _mixtral_config(cfg, common)
    if cfg.qkv_bias:
        return Qwen2Config(**common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _mixtral_config(cfg: ModelConfig, common: dict):
    """MixtralConfig for a llama-family MoE; refuses what Mixtral cannot express."""
    from transformers import MixtralConfig

    problems = []
    if cfg.family != "llama" or cfg.qkv_bias:
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


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and for GPT-2, fuse and transpose) suite weights into the HF layout."""
    if cfg.fused_projections:
        sd = unfuse_state_dict(cfg, sd)
    out: dict[str, torch.Tensor] = {}
    if cfg.family == "gpt":
        out["transformer.wte.weight"] = sd["tok_embeddings.weight"]
        out["transformer.wpe.weight"] = sd["pos_embeddings.weight"]
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
                out[q + theirs + ".weight"] = sd[p + ours + ".weight"]
                out[q + theirs + ".bias"] = sd[p + ours + ".bias"]
            att = p + "attention."
            out[q + "attn.c_attn.weight"] = torch.cat(
                [sd[att + n + ".weight"] for n in ("wq", "wk", "wv")]
            ).t()
            out[q + "attn.c_attn.bias"] = torch.cat([sd[att + n + ".bias"] for n in ("wq", "wk", "wv")])
            out[q + "attn.c_proj.weight"] = sd[att + "wo.weight"].t()
            out[q + "attn.c_proj.bias"] = sd[att + "wo.bias"]
            out[q + "mlp.c_fc.weight"] = sd[p + "feed_forward.w1.weight"].t()
            out[q + "mlp.c_fc.bias"] = sd[p + "feed_forward.w1.bias"]
            out[q + "mlp.c_proj.weight"] = sd[p + "feed_forward.w2.weight"].t()
            out[q + "mlp.c_proj.bias"] = sd[p + "feed_forward.w2.bias"]
        out["transformer.ln_f.weight"] = sd["norm.weight"]
        out["transformer.ln_f.bias"] = sd["norm.bias"]
        out["lm_head.weight"] = sd["output.weight"]
    else:
        for ours, theirs in _llama_names(cfg):
            out[theirs] = sd[ours]
        for i in moe_layer_ids(cfg):
            p, q = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
            out[q + "gate_up_proj"] = torch.cat([sd[p + "w1"], sd[p + "w3"]], dim=1)
            out[q + "down_proj"] = sd[p + "w2"]
    return {k: v.contiguous() for k, v in out.items()}


def _llama_names(cfg: ModelConfig) -> list[tuple[str, str]]:
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
        if i in moe_layer_ids(cfg):  # experts are stacked tensors: mapped in to/from_hf_state_dict
            names.append((p + "feed_forward.router.weight", q + "mlp.gate.weight"))
            continue
        for ours, theirs in mlp.items():
            names.append((f"{p}feed_forward.{ours}.weight", f"{q}mlp.{theirs}.weight"))
    return names


# ---- HF -> suite -------------------------------------------------------------------------------
def model_config_from_hf(folder: Path, where: str | None = None) -> ModelConfig:
    """Read config.json through transformers (no remote code) into a suite ModelConfig; `where`
    names the source in errors as the user wrote it (suite.sources: "ckpt='hf:DIR'")."""
    from transformers import AutoConfig

    where = where or f"the HF folder {folder}"

    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json; give a folder written by save_pretrained")
    hf = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    if hf.model_type not in SUPPORTED:
        raise ConfigError(
            f"{where} is a '{hf.model_type}' model; importable architectures: {', '.join(SUPPORTED)}"
        )
    if hf.model_type == "gpt2":
        if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(
                f"{where}: activation '{hf.activation_function}' is not supported; use gelu_new"
            )
        return ModelConfig(
            name=folder.name,
            family="gpt",
            num_layers=hf.n_layer,
            hidden_size=hf.n_embd,
            num_heads=hf.n_head,
            ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
            vocab_size=hf.vocab_size,
            max_seq_len=hf.n_positions,
            norm_eps=hf.layer_norm_epsilon,
            tie_embeddings=bool(hf.tie_word_embeddings),
        )
    head_dim = getattr(hf, "head_dim", None)
    if head_dim == hf.hidden_size // hf.num_attention_heads and not hf.hidden_size % hf.num_attention_heads:
        head_dim = None  # the default: hidden_size / heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    qkv_bias = hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
    if hf.model_type == "llama" and getattr(hf, "attention_bias", False):
        raise ConfigError(f"{where}: Llama with attention_bias (bias on o_proj too) is not supported")
    moe = {}
    if hf.model_type == "mixtral":
        moe = dict(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size,
            aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.01)),
        )
    return ModelConfig(
        **moe,
        name=folder.name,
        family="llama",
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        norm_eps=hf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.tie_word_embeddings),
    )


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of to_hf_state_dict (HF names -> suite names)."""
    sd: dict[str, torch.Tensor] = {}
    if cfg.family == "gpt":
        h, kv = cfg.num_heads * head_size(cfg), kv_heads(cfg) * head_size(cfg)
        get = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
        sd["tok_embeddings.weight"] = get["wte.weight"]
        sd["pos_embeddings.weight"] = get["wpe.weight"]
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"h.{i}."
            for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
                sd[p + ours + ".weight"] = get[q + theirs + ".weight"]
                sd[p + ours + ".bias"] = get[q + theirs + ".bias"]
            wq, wk, wv = get[q + "attn.c_attn.weight"].t().split([h, kv, kv])
            bq, bk, bv = get[q + "attn.c_attn.bias"].split([h, kv, kv])
            for name, w, b in (("wq", wq, bq), ("wk", wk, bk), ("wv", wv, bv)):
                sd[f"{p}attention.{name}.weight"], sd[f"{p}attention.{name}.bias"] = w, b
            sd[p + "attention.wo.weight"] = get[q + "attn.c_proj.weight"].t()
            sd[p + "attention.wo.bias"] = get[q + "attn.c_proj.bias"]
            sd[p + "feed_forward.w1.weight"] = get[q + "mlp.c_fc.weight"].t()
            sd[p + "feed_forward.w1.bias"] = get[q + "mlp.c_fc.bias"]
            sd[p + "feed_forward.w2.weight"] = get[q + "mlp.c_proj.weight"].t()
            sd[p + "feed_forward.w2.bias"] = get[q + "mlp.c_proj.bias"]
        sd["norm.weight"], sd["norm.bias"] = get["ln_f.weight"], get["ln_f.bias"]
        sd["output.weight"] = hf_sd.get("lm_head.weight", get["wte.weight"])
    else:
        # Mixtral folders name the MoE block block_sparse_moe (per-expert files) or mlp (fused)
        hf_sd = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in hf_sd.items()}
        for ours, theirs in _llama_names(cfg):
            if theirs == "lm_head.weight" and theirs not in hf_sd:
                sd[ours] = hf_sd["model.embed_tokens.weight"]  # tied: saved once
            else:
                sd[ours] = hf_sd[theirs]
        for i in moe_layer_ids(cfg):
            p, q = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
            if q + "gate_up_proj" in hf_sd:
                sd[p + "w1"], sd[p + "w3"] = hf_sd[q + "gate_up_proj"].chunk(2, dim=1)
                sd[p + "w2"] = hf_sd[q + "down_proj"]
            else:
                for ours in ("w1", "w2", "w3"):
                    sd[p + ours] = torch.stack(
                        [hf_sd[f"{q}{e}.{ours}.weight"] for e in range(cfg.num_experts)]
                    )
    if cfg.fused_projections:
        sd = fuse_state_dict(cfg, sd)
    return {k: v.contiguous() for k, v in sd.items()}


def on_disk_names(cfg: ModelConfig, hf_sd: dict) -> dict:
    """The names transformers' save_pretrained writes: Mixtral experts one by one
    (block_sparse_moe.experts.N.w1/w2/w3), as older transformers and other tools read them."""
    if not cfg.num_experts:
        return hf_sd
    out = {}
    for name, value in hf_sd.items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.")
            for e in range(value.shape[0]):
                w1, w3 = value.select(0, e).chunk(2, dim=0)
                out[f"{prefix}{e}.w1.weight"], out[f"{prefix}{e}.w3.weight"] = w1, w3
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts.")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.w2.weight"] = value.select(0, e)
        elif ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value
        else:
            out[name] = value
    return out
