"""Exact weight and config mapping between suite models and Hugging Face transformers classes.

Each family's folder holds its own mapping (suite/models/<family>/convert.py, registered as its
`Family.hf`); this module is the one entry the readers and writers call. Config objects come from
transformers' own config classes, never written by hand. A model with fused projections
(model.fused_projections: wqkv, w13) is converted through the unfused names
(suite.models.transformer.unfuse_state_dict / fuse_state_dict).

Pure functions of a config and a dict of tensors: they run unchanged on lazy tensors
(suite.models.lazy), which is how import and export read one tensor, or one shard, at a time.
Reading and writing files is suite.model_source (import) and suite.export.hf (export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import family_for_hf, family_of, hf_model_types
from suite.models.transformer import fuse_state_dict, unfuse_state_dict


# ---- suite -> HF -------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, eos_id: int | None = None, pad_id: int | None = None) -> Any:
    """The transformers config object that describes the same architecture."""
    special = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    return family_of(cfg).hf.to_config(cfg, special)


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and where the family's layout says so, fuse and transpose) suite weights into HF's."""
    if cfg.fused_projections:
        sd = unfuse_state_dict(cfg, sd)
    out = family_of(cfg).hf.to_state_dict(cfg, sd)
    return {k: v.contiguous() for k, v in out.items()}


def on_disk_names(cfg: ModelConfig, hf_sd: dict) -> dict:
    """The names transformers' save_pretrained writes, where the family's differ (Mixtral's experts)."""
    return family_of(cfg).hf.on_disk_names(cfg, hf_sd)


# ---- HF -> suite -------------------------------------------------------------------------------
def model_config_from_hf(folder: Path, where: str | None = None) -> ModelConfig:
    """Read config.json through transformers (no remote code) into a suite ModelConfig; `where`
    names the source in errors as the user wrote it (suite.model_source: "ckpt='hf:DIR'")."""
    # deferred: transformers costs seconds to import; only converting to/from HF needs it
    from transformers import AutoConfig

    where = where or f"the HF folder {folder}"
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json; give a folder written by save_pretrained")
    hf = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    family = family_for_hf(hf.model_type)
    if family is None:
        raise ConfigError(
            f"{where} is a '{hf.model_type}' model; importable architectures: {', '.join(hf_model_types())}"
        )
    return ModelConfig(name=folder.name, family=family.name, **family.hf.from_config(hf, where))


def from_hf_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of to_hf_state_dict (HF names -> suite names)."""
    sd = family_of(cfg).hf.from_state_dict(cfg, hf_sd)
    if cfg.fused_projections:
        sd = fuse_state_dict(cfg, sd)
    return {k: v.contiguous() for k, v in sd.items()}
