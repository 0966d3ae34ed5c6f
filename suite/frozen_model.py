"""A frozen second model placed like the one being trained: distillation's teacher, a preference
method's reference model.

The model is parallelised by the same `parallelize` as the trained model (same mesh and data-parallel
kind: sharded under FSDP, so no rank holds a whole frozen model it would not hold a whole trained
one of), loaded from its source (suite.model_source.ModelSource: a suite run/checkpoint or
hf:<folder>, resharded to this layout), set to eval mode with every parameter frozen. Under pipeline
parallelism (`whole=True`) it is built whole and plain on every rank instead: a method whose loss
runs on the last stage keeps it there only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, RecomputeConfig, SuiteConfig
from suite.model_source import ModelSource
from suite.models import build_model, materialize
from suite.parallel.dims import ParallelDims
from suite.parallel.parallelize import Placement, parallelize
from suite.runtime import PrecisionPolicy


@dataclasses.dataclass
class FrozenModel:
    """A placed, loaded, frozen model; `placement` is None when it was built whole (`whole=True`)."""

    model: nn.Module
    source: ModelSource
    input_device: torch.device
    placement: Placement | None


def frozen_model_config(cfg: SuiteConfig, source: ModelSource, key: str) -> ModelConfig:
    """`source`'s architecture, checked against the trained model's vocabulary (one tokenizer)."""
    if source.lora is not None:
        raise ConfigError(
            f"{source.named} holds LoRA adapters beside its base; export it with merge_lora=true and "
            f"use {key}=hf:<that folder>"
        )
    model_cfg = source.model_config()
    if model_cfg.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"{key} has model.vocab_size={model_cfg.vocab_size} but the trained model has "
            f"model.vocab_size={cfg.model.vocab_size}; both models must share the tokenizer and vocabulary"
        )
    if source.is_hf:  # an HF folder never fuses; keep the trained model's layout choice for speed
        model_cfg = dataclasses.replace(model_cfg, fused_projections=cfg.model.fused_projections)
    return dataclasses.replace(model_cfg, dropout=0.0, init_from=None)


def load_frozen(
    cfg: SuiteConfig,
    dims: ParallelDims,
    device: torch.device,
    precision: PrecisionPolicy,
    source: ModelSource,
    key: str,
    whole: bool = False,
) -> FrozenModel:
    """The model `source` (named by the config key `key`), placed like the trained model and frozen."""
    model_cfg = frozen_model_config(cfg, source, key)
    # no backward through a frozen model: nothing to recompute
    frozen_cfg = dataclasses.replace(cfg, model=model_cfg, recompute=RecomputeConfig())
    placement = None
    if whole:
        model = materialize(build_model(model_cfg, "meta"), device, cfg.train.seed).to(precision.param_dtype)
        input_device = device
    else:
        placement = parallelize(build_model(model_cfg, "meta"), frozen_cfg, dims, device, precision)
        model = placement.model
        if placement.materialized is False:
            materialize(model, device, cfg.train.seed)
        input_device = placement.input_device()  # read off the materialised parameters
    source.load_weights(model, model_cfg.fused_projections)
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    return FrozenModel(model, source, input_device, placement)
