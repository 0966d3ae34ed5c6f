"""Model families as registered plug-ins: what a family is, and the one table of them.

A family (suite/models/<name>/) describes itself with a `Family`: the traits the shared blocks of
suite/models/transformer.py read (which norm, which MLP, how positions enter, biases, q/k norms), and
its converters (the Hugging Face config and weight names both ways, llama.cpp's GGUF architecture).
Code outside a family's folder asks `family_of(cfg)` for traits and converters and never compares a
family's name: adding a family is one folder plus one import line in suite/models/__init__.py, which
is what fills the table (see docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face side: which transformers `model_type`s it imports, and pure functions
    of a config and a dict of (possibly lazy, suite.models.lazy) tensors."""

    model_types: tuple[str, ...]
    # suite config -> the transformers config object (special: bos/eos/pad token ids)
    to_config: Callable[[ModelConfig, dict[str, Any]], Any]
    # transformers config -> suite ModelConfig fields (name excluded); `where` names the source in errors
    from_config: Callable[[Any, str], dict[str, Any]]
    to_state_dict: Callable[[ModelConfig, StateDict], StateDict]
    from_state_dict: Callable[[ModelConfig, StateDict], StateDict]
    # the names transformers' save_pretrained writes, where they differ from to_state_dict's
    on_disk_names: Callable[[ModelConfig, StateDict], StateDict] = lambda cfg, sd: sd
    # why this model cannot be an HF folder at all (None: it can)
    export_problem: Callable[[ModelConfig], str | None] = lambda cfg: None
    # why a `suite quantize` checkpoint of this family cannot be written with TorchAoConfig (None: it can)
    quantized_problem: str | None = None


@dataclass(frozen=True)
class GGUFMapping:
    """A family's llama.cpp side: the GGUF architecture, the HF weights stored transposed, what the
    architecture cannot hold, and the hyper-parameter keys it reads."""

    arch: str  # llama.cpp's architecture name (gguf.MODEL_ARCH by its lower-case name)
    add_hparams: Callable[[Any, ModelConfig], None]
    problem: Callable[[ModelConfig], str | None] = lambda cfg: None
    transposed: tuple[str, ...] = ()  # HF weight-name suffixes stored [in, out] (GPT-2's Conv1D)
    permute_qk: bool = True  # rotate-half q/k rows -> llama.cpp's interleaved rotary pairs
    # what transformers' GGUF reader needs beside the file to rebuild the model
    load_kwargs: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    # importing a GGUF (suite.gguf_file): what transformers' GGUF config reader misses, from the file's
    # `<arch>.*` keys (prefix removed), passed to AutoConfig beside the file
    config_kwargs: Callable[[dict[str, Any]], dict[str, Any]] = lambda fields: {}
    # the architecture of one model where it varies (Qwen3-MoE is qwen3moe); None: always `arch`
    arch_for: Callable[[ModelConfig], str] | None = None
    other_archs: tuple[str, ...] = ()  # the further architectures arch_for writes (read back as this family)
    # llama.cpp's KV head count where it is not the model's (MLA is stored as one shared latent head)
    kv_heads: Callable[[ModelConfig], int] | None = None
    # the family's own tensors for one HF tensor: [(gguf name, fp32 tensor)] where gguf's name map cannot
    # take it as it is (stacked experts, MLA's kv_b split per head); None: the name map's
    tensors: Callable[[ModelConfig, str, Any], list[tuple[str, torch.Tensor]] | None] = (
        lambda cfg, name, value: None
    )
    # why transformers' GGUF reader (the export's logits self-check) cannot rebuild a file of this
    # architecture (None: it can); llama.cpp reads it all the same
    unreadable: Callable[[str], str | None] = lambda arch: None
    # why `ckpt=gguf:` (suite.gguf_file) cannot import a file of this architecture (None: it can)
    import_problem: Callable[[str], str | None] = lambda arch: None

    def arch_of(self, cfg: ModelConfig) -> str:
        """The llama.cpp architecture this model is written as."""
        return self.arch_for(cfg) if self.arch_for else self.arch

    def archs(self) -> tuple[str, ...]:
        return (self.arch, *self.other_archs)


@dataclass(frozen=True)
class Family:
    """One model family: traits the shared layers build from, and its converters."""

    name: str
    summary: str
    rms_norm: bool  # RMSNorm (else LayerNorm with bias)
    swiglu: bool  # SwiGLU MLP: gate, up, down (else tanh-GELU fc, proj)
    rope: bool  # rotary positions (else a learned position table)
    linear_bias: bool  # every projection carries a bias (GPT-2)
    default_ffn: Callable[[ModelConfig], int]
    hf: HFMapping
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    gguf: GGUFMapping | None = None
    # torch.compile the blocks under train.compile=auto (elementwise work worth fusing: norms, RoPE, SwiGLU)
    compile_auto: bool = False
    checks: Callable[[ModelConfig], None] = field(default=lambda cfg: None)
    # the block's attention module (None: the shared suite.models.transformer.Attention)
    attention: Callable[[ModelConfig], nn.Module] | None = None
    # how many of a head's dims RoPE rotates (None: the whole head, head_size)
    rotary_dim: Callable[[ModelConfig], int] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family to the table (each family's __init__ calls this once)."""
    if family.name in FAMILIES:
        raise RuntimeError(f"model family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


def family_of(cfg: ModelConfig) -> Family:
    """The family a model config names; a ConfigError naming the registered ones otherwise."""
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise ConfigError(
            f"model.family={cfg.family!r} is not a model family; use one of {', '.join(sorted(FAMILIES))}"
        ) from None


def family_for_hf(model_type: str) -> Family | None:
    """The family that imports a transformers `model_type` (None: no family does)."""
    for family in FAMILIES.values():
        if model_type in family.hf.model_types:
            return family
    return None


def hf_model_types() -> list[str]:
    return [t for family in FAMILIES.values() for t in family.hf.model_types]


# ---- the dimensions every family shares --------------------------------------------------------
def ffn_size(cfg: ModelConfig) -> int:
    """The MLP width: model.ffn_hidden_size, or the family's default for the hidden size."""
    return cfg.ffn_hidden_size or family_of(cfg).default_ffn(cfg)


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads or cfg.num_heads


def head_size(cfg: ModelConfig) -> int:
    """The width of one attention head: model.head_dim, or hidden_size // num_heads when unset."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_heads


def rotary_size(cfg: ModelConfig) -> int:
    """The dims of a head that RoPE rotates (the family says; the whole head by default)."""
    rotary = family_of(cfg).rotary_dim
    return rotary(cfg) if rotary else head_size(cfg)
