"""The model section's relations between keys (heads, widths, experts), checked before launch."""

from __future__ import annotations

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.document_attention import DOCUMENT_ATTENTIONS
from suite.models.family import family_of, head_size
from suite.models.moe import check_moe_config


def check_model(m: ModelConfig) -> None:
    """One-line ConfigErrors for architectures the blocks cannot build."""
    family = family_of(m)  # an unregistered model.family: one line naming the registered ones
    if m.head_dim is not None and m.head_dim < 1:
        raise ConfigError(
            f"model.head_dim={m.head_dim} must be a positive integer, or null (hidden_size / num_heads)"
        )
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            "pick heads that divide the hidden size (or set model.head_dim)"
        )
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads % kv:
        raise ConfigError(
            f"model.num_kv_heads={kv} does not divide model.num_heads={m.num_heads}; use a divisor of {m.num_heads}"
        )
    if family.rope and head_size(m) % 2:
        what = "model.head_dim" if m.head_dim else "model.hidden_size/model.num_heads"
        raise ConfigError(f"{what}={head_size(m)} must be even for RoPE")
    if m.num_mtp_layers < 0:
        raise ConfigError(f"model.num_mtp_layers={m.num_mtp_layers} must be >= 0 (DeepSeek-V3: 1; 0: off)")
    family.checks(m)
    if m.document_attention not in DOCUMENT_ATTENTIONS:
        raise ConfigError(
            f"model.document_attention={m.document_attention!r} is not one of {', '.join(DOCUMENT_ATTENTIONS)}; "
            "use varlen (per-document attention) or dense (the [seq, seq] mask)"
        )
    if m.num_experts > 0:
        check_moe_config(m)
