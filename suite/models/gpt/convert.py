"""GPT-2's Hugging Face and GGUF layouts: GPT2LMHeadModel's Conv1D weights are [in, out] (transposed)
and its q/k/v are one fused c_attn; llama.cpp's gpt2 architecture stores the same names."""

from __future__ import annotations

from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import ffn_size, head_size, kv_heads

GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(cfg: ModelConfig, special: dict[str, Any]) -> Any:
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import GPT2Config

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


def config_from_hf(hf: Any, where: str) -> dict[str, Any]:
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{where}: activation '{hf.activation_function}' is not supported; use gelu_new")
    return dict(
        num_layers=hf.n_layer,
        hidden_size=hf.n_embd,
        num_heads=hf.n_head,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.n_positions,
        norm_eps=hf.layer_norm_epsilon,
        tie_embeddings=bool(hf.tie_word_embeddings),
    )


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    out["transformer.wte.weight"] = sd["tok_embeddings.weight"]
    out["transformer.wpe.weight"] = sd["pos_embeddings.weight"]
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[q + theirs + ".weight"] = sd[p + ours + ".weight"]
            out[q + theirs + ".bias"] = sd[p + ours + ".bias"]
        att = p + "attention."
        out[q + "attn.c_attn.weight"] = torch.cat([sd[att + n + ".weight"] for n in ("wq", "wk", "wv")]).t()
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
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
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
    return sd


def hf_export_problem(cfg: ModelConfig) -> str | None:
    """GPT-2's config derives the head size as n_embd / n_head (transformers' GPT2Attention; no
    pruned_heads either): a pruned GPT whose heads keep their size cannot be written."""
    heads, size = cfg.num_heads, head_size(cfg)
    if cfg.hidden_size == heads * size:
        return None
    return (
        f"model.head_dim={size} with model.hidden_size={cfg.hidden_size} and model.num_heads={heads}: "
        "GPT-2's Hugging Face config cannot hold a head size other than hidden_size / num_heads, so this "
        "pruned GPT model does not export (it runs in the suite: generate, eval, finetune, distill); prune "
        f"the hidden channels with the heads (e.g. prune.hidden = prune.heads: hidden {heads * size} for "
        f"{heads} heads of {size}), or prune.ffn / prune.layers only"
    )


def gguf_problem(cfg: ModelConfig) -> str | None:
    if ffn_size(cfg) != 4 * cfg.hidden_size:
        return (
            f"model.ffn_hidden_size={ffn_size(cfg)} is not 4 x hidden_size: transformers' GGUF reader builds "
            "GPT-2 with the default 4 x n_embd MLP"
        )
    return None


def gguf_hparams(writer: Any, cfg: ModelConfig) -> None:
    writer.add_layer_norm_eps(cfg.norm_eps)


def gguf_load_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' GGUF mapping reads GPT-2's context_length into n_ctx, not n_positions, so a GPT-2
    whose context is not the default 1024 is built with 1024 positions (a size mismatch) unless
    n_positions is passed. The file itself is right for llama.cpp (position_embd has context_length rows)."""
    return {"n_positions": cfg.max_seq_len} if cfg.max_seq_len != 1024 else {}


def gguf_config_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """Importing a GPT-2 GGUF: its context length as n_positions (see gguf_load_kwargs)."""
    context = fields.get("context_length")
    return {"n_positions": int(context)} if context else {}
