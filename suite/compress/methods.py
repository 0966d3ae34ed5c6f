"""Applying the `compress.method` a user names to a model: which Linear layers, then the method's own
`quantize` (the methods are classes in the registry, suite.models.compression; `suite quantize --help`
lists them).

Only nn.Linear modules are quantized; names matching a compress.skip pattern stay in full precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from suite.config.schema import CompressConfig
from suite.models.compression import for_training, get, is_none, skipped
from suite.models.gptq import Grid, store_values
from suite.models.quantized import quiet_torchao

__all__ = [
    "grid_for",
    "linear_plan",
    "quantize_model",
    "rtn_config",
    "skipped",
    "torchao_config",
    "usable_scales",
]


def torchao_config(cfg: CompressConfig, device: torch.device) -> Any:
    """The torchao config that quantizes one Linear for `cfg.method` on `device`."""
    return get(cfg.method).torchao_config(cfg, device)


def grid_for(method: str, group_size: int) -> Grid:
    """The grid a method stores given integers and scales on (GPTQ's; QAT's learned scales)."""
    grid = get(method).grid(CompressConfig(method=method, group_size=group_size))
    if grid is None:
        raise ValueError(f"compress.method={method!r} has no grid of its own to store given values on")
    return grid


def rtn_config(method: str, group_size: int) -> Any:
    """The round-to-nearest torchao config whose grid and tensor type a GPTQ method shares (on any
    device: the integers and scales are GPTQ's own, computed in suite.models.gptq)."""
    return grid_for(method, group_size).torchao_config()


TIED_HEAD = "output"  # the Linear whose weight is tok_embeddings.weight when model.tie_embeddings


def linear_plan(model: nn.Module, patterns: Iterable[str]) -> tuple[list[str], list[str]]:
    """(Linear modules to quantize, Linear modules skipped), by name. A tied output head is always
    skipped, whatever compress.skip says: its weight is the embedding's, which stays in full
    precision, and the checkpoint stores that tensor once; quantizing the head would untie it in
    memory only, and the model on disk would not be the one measured."""
    patterns = list(patterns)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    quantized, skip = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            keep = skipped(name, patterns) or (tied and name == TIED_HEAD)
            (skip if keep else quantized).append(name)
    return quantized, skip


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    cfg: CompressConfig,
    device: torch.device,
    calibrate: Callable[[nn.Module], None] | None = None,
    learned_scales: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[str], list[str]]:
    """Quantize `model`'s Linear layers in place; returns (quantized names, skipped Linear names).

    `calibrate(model)` runs the calibration forwards (a method that needs_calibration) when the method
    asks. `learned_scales` (a compress=qat-* run's, usable_scales): stored on those scales.
    """
    quiet_torchao()
    targets, skip = linear_plan(model, cfg.skip)
    if learned_scales:
        _quantize_on_scales(model, targets, cfg, learned_scales)
    else:
        get(cfg.method).quantize(model, targets, cfg, device, calibrate)
    if not is_none(cfg.embedding):  # int8, the one choice (suite.config.validate)
        quantize_embedding(model)
    return targets, skip


EMBEDDING = "tok_embeddings"


def quantize_embedding(model: nn.Module) -> None:
    """compress.embedding=int8: the token embedding as int8, one scale per row (torchao's
    IntxUnpackedToInt8Tensor, which computes both the lookup and a tied head's matmul); a tied output
    head is re-tied to it, so the checkpoint stores the int8 table once."""
    # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
    from torchao.quantization import IntxWeightOnlyConfig, PerAxis, quantize_

    config = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    quantize_(model, config, lambda m, n: n == EMBEDDING and isinstance(m, nn.Embedding))
    if getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        model.tie_weights()


def usable_scales(
    model: nn.Module, cfg: CompressConfig, scales: Mapping[str, torch.Tensor], trained_for: str
) -> dict:
    """The learned scales (by Linear name) of a run trained with compress.method=`trained_for` that fit
    cfg's grid: the method that run converts to (qat-int4 -> int4 at compress.group_size, qat-int8 ->
    int8 per row) and the shape it trained; {} otherwise (round to nearest)."""
    method = get(cfg.method)
    if not scales or for_training(trained_for) is not method or method.grid(cfg) is None:
        return {}
    modules = dict(model.named_modules())
    fits = {}
    for name, scale in scales.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            continue
        rows, cols = module.weight.shape
        if tuple(scale.shape) != (rows, method.scale_groups(cfg, cols)):
            return {}
        fits[name] = scale
    return fits


def _quantize_on_scales(
    model: nn.Module, targets: list[str], cfg: CompressConfig, scales: Mapping[str, torch.Tensor]
) -> None:
    """Each target with a learned scale rounded on it exactly as QAT's forward rounded (the integers
    training saw), stored as GPTQ stores on any device: the CPU int4 layout (IntxUnpackedToInt8Tensor,
    bf16 scales; not CUDA's tinygemm layout, whose grid is another) or int8 per row; targets without
    one are rounded to nearest."""
    grid = get(cfg.method).grid(cfg)
    modules = dict(model.named_modules())
    trained = {}
    for name in targets:
        if name in scales:
            weight = modules[name].weight.float()
            scale = scales[name].to(weight.device, torch.float32)
            grouped = weight.reshape(weight.shape[0], scale.shape[1], -1)
            trained[name] = (grid.quantize(grouped, scale.unsqueeze(-1)).reshape(weight.shape), scale)
    store_values(model, targets, grid, trained)
