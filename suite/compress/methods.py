"""The quantization methods `compress.method` names, and applying one to a model with torchao.

    int8           Int8WeightOnlyConfig: int8 weights (one scale per output row), float activations
    w8a8           Int8DynamicActivationInt8WeightConfig: int8 weights, activations quantized per
                   token on the fly, int8 matmuls
    int4           group-wise 4-bit weights (compress.group_size per scale): on CPU
                   IntxWeightOnlyConfig(int4, PerGroup, bf16 scales), on CUDA Int4WeightOnlyConfig
                   (a QAT run's learned scales: the CPU layout on any device, as gptq)
    int4-tinygemm  Int4WeightOnlyConfig on any device: CUDA only (torchao's tinygemm kernels)
    smoothquant    w8a8 after SmoothQuant (activation outliers moved onto the weights, with scales
                   observed on compress.calib_samples sequences of the recipe's data)
    gptq           int4's grid (group-wise, CPU layout) with GPTQ's error compensation on calibration
                   data (suite.compress.gptq, plain torch: CPU and CUDA)
    gptq-int8      int8 weight-only's grid (per output row) with GPTQ's error compensation

Only nn.Linear modules are quantized; names matching a compress.skip pattern stay in full precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from suite.config.schema import CompressConfig
from suite.models.qat import skipped
from suite.models.quantized import quiet_torchao


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    cuda_only: bool = False
    calibrated: bool = False
    # float activations: gradients reach a layer's input (LoRA over it trains what lies below)
    weight_only: bool = True


METHODS = {
    m.name: m
    for m in (
        Method("int8", "int8 weight-only (torchao Int8WeightOnlyConfig)"),
        Method(
            "w8a8",
            "int8 dynamic activations + int8 weights (Int8DynamicActivationInt8WeightConfig)",
            weight_only=False,
        ),
        Method(
            "int4", "group-wise int4 weight-only (IntxWeightOnlyConfig on CPU, Int4WeightOnlyConfig on CUDA)"
        ),
        Method(
            "int4-tinygemm", "int4 weight-only with torchao's tinygemm kernels (Int4WeightOnlyConfig)", True
        ),
        Method(
            "smoothquant",
            "w8a8 after SmoothQuant calibration (torchao prototype)",
            calibrated=True,
            weight_only=False,
        ),
        Method("gptq", "group-wise int4 weights placed by GPTQ (plain torch, any device)", calibrated=True),
        Method("gptq-int8", "int8 weights placed by GPTQ (plain torch, any device)", calibrated=True),
    )
}
# named in the issue, not built yet: what to use instead
NOT_BUILT = {
    "qat-int4": "quantization-aware training is a training option: suite finetune compress=qat-int4 (or "
    "suite pretrain), which converts its final checkpoint to int4 itself; post-training: compress=int4",
    "qat-int8": "quantization-aware training is a training option: suite finetune compress=qat-int8 (or "
    "suite pretrain), which converts its final checkpoint to int8 itself; post-training: compress=int8",
}


def torchao_config(cfg: CompressConfig, device: torch.device):
    """The torchao config that quantizes one Linear for `cfg.method` on `device`."""
    quiet_torchao()
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        PerGroup,
    )

    method = cfg.method
    if method in ("gptq", "gptq-int8"):
        return rtn_config(method, cfg.group_size)
    if method == "int8":
        return Int8WeightOnlyConfig()
    if method in ("w8a8", "smoothquant"):
        return Int8DynamicActivationInt8WeightConfig()
    if method == "int4-tinygemm" or (method == "int4" and device.type == "cuda"):
        return Int4WeightOnlyConfig(group_size=cfg.group_size)
    if method == "int4":
        return IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(cfg.group_size), scale_dtype=torch.bfloat16
        )
    raise ValueError(f"compress.method={method!r} has no torchao config")


def rtn_config(method: str, group_size: int):
    """The round-to-nearest torchao config whose grid and tensor type a GPTQ method shares (on any
    device: the integers and scales are GPTQ's own, computed in suite.compress.gptq)."""
    quiet_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    if method == "gptq":
        return IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(group_size), scale_dtype=torch.bfloat16
        )
    if method == "gptq-int8":
        return Int8WeightOnlyConfig()
    raise ValueError(f"compress.method={method!r} is not a GPTQ method")


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

    `calibrate(model)` runs the calibration forwards (smoothquant) between observing and converting.
    `learned_scales` (a compress=qat-* run's, usable_scales): int4 / int8 on those scales.
    """
    quiet_torchao()
    from torchao.quantization import quantize_

    targets, skip = linear_plan(model, cfg.skip)
    wanted = set(targets)

    def only_targets(module: nn.Module, name: str) -> bool:
        return name in wanted

    if learned_scales:
        _quantize_on_scales(model, targets, cfg, learned_scales)
        return targets, skip
    if cfg.method.startswith("gptq"):
        from suite.compress.gptq import gptq_quantize

        gptq_quantize(
            model, targets, cfg.method, cfg.group_size, cfg.gptq_damp, calibrate or (lambda m: None)
        )
        return targets, skip
    base = torchao_config(cfg, device)
    if cfg.method == "smoothquant":
        from torchao.prototype.smoothquant import SmoothQuantConfig

        quantize_(model, SmoothQuantConfig(base, step="prepare", alpha=cfg.smoothquant_alpha), only_targets)
        if calibrate is not None:
            calibrate(model)
        quantize_(model, SmoothQuantConfig(base, step="convert", alpha=cfg.smoothquant_alpha), only_targets)
    else:
        quantize_(model, base, only_targets)
    return targets, skip


LEARNED_GRIDS = {"int4": "gptq", "int8": "gptq-int8"}  # a QAT conversion's method -> the GPTQ grid it shares


def usable_scales(
    model: nn.Module, cfg: CompressConfig, scales: Mapping[str, torch.Tensor], trained_for: str
) -> dict:
    """The learned scales (by Linear name) of a run trained with compress.method=`trained_for` that fit
    cfg's grid: the method that run converts to (qat-int4 -> int4 at compress.group_size, qat-int8 ->
    int8 per row) and the shape it trained; {} otherwise (round to nearest)."""
    from suite.models.qat import QAT_METHODS

    if cfg.method not in LEARNED_GRIDS or not scales or QAT_METHODS.get(trained_for) != cfg.method:
        return {}
    modules = dict(model.named_modules())
    fits = {}
    for name, scale in scales.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            continue
        rows, cols = module.weight.shape
        groups = cols // cfg.group_size if cfg.method == "int4" else 1
        if tuple(scale.shape) != (rows, groups):
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
    from suite.compress.gptq import grid_for, store_values

    grid = grid_for(LEARNED_GRIDS[cfg.method], cfg.group_size)
    modules = dict(model.named_modules())
    trained = {}
    for name in targets:
        if name in scales:
            weight = modules[name].weight.float()
            scale = scales[name].to(weight.device, torch.float32)
            grouped = weight.reshape(weight.shape[0], scale.shape[1], -1)
            trained[name] = (grid.quantize(grouped, scale.unsqueeze(-1)).reshape(weight.shape), scale)
    store_values(model, targets, LEARNED_GRIDS[cfg.method], cfg.group_size, trained)
