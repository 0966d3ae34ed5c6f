"""Quantization-aware training (`compress=qat-int4|qat-int8` on `suite pretrain` / `suite finetune`).

Before the model is placed, torchao's QATConfig(step="prepare") swaps every Linear the final
quantization will convert (those not matched by `compress.skip`) for a FakeQuantizedLinear: the
forward rounds its weight to the target grid (int4 in groups of `compress.group_size` along the input,
or int8 per output row: the same schemes `suite quantize` applies on this device), the backward passes
gradients straight through. The weights keep their names, so placement, checkpoints and resume are
those of any run (learned scales add parameters beside them: below); at the end the CLI converts
the final checkpoint with `suite quantize`'s code into `<run.dir>-<int4|int8>` (suite.compress). Fake quantization sees whole weights: data parallelism and
FSDP (which gathers the weight before the forward) run it as one process does; tp, pp, cp and ep are
refused for now (suite.compress.checks).

compress.learn_scales (the default): the scales are parameters trained with the weights (learned step
size quantization, torchao's range learning), each starting at the max|w| / 7.5 (int8: 127.5) that the
per-step computation gives; they live in the checkpoint beside the weights (`<linear>` + LEARNED_SCALE,
left out wherever the run is read as a float model: suite.model_source.training_only) and the conversion
stores them with the integers training rounded to (the method's grid, suite.compress.methods): exactly, where the
parameters are fp32; under bf16 parameters (FSDP's mixed precision, train.param_dtype) the forward
rounds bf16 weights on bf16 scales, as the weights themselves were only ever seen in bf16 there.
A scale the optimizer drives below zero still rounds symmetrically (w / s and q * s both change sign;
the grid's one extra negative step moves to the positive side) and the conversion stores it as it is.
That happens: AdamW steps a scale by ~lr whatever its size, and near-zero groups (attention output
projections) have scales of that order. Flooring them at float32's eps instead was tried and not kept:
it zeroes a floored group, so at a large learning rate the float model and its int4 drift apart
(docs/compression.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from suite.config.schema import CompressConfig
from suite.models.compression import for_training, qat_target, skipped, training_names
from suite.models.quantized import quiet_torchao

# the training option -> the post-training method it converts to (derived from the registry)
QAT_METHODS = {name: qat_target(name) for name in training_names()}
LEARNED_SCALE = ".weight_fake_quantizer.scale"  # a learned scale's key: the Linear's name + this


def prepare_qat(model: nn.Module, compress: CompressConfig) -> list[str]:
    """Fake-quantize `model`'s Linear layers in place for a training option (compress=qat-*: the
    method's training-time half, suite.models.compression); returns their names (none otherwise)."""
    method = for_training(compress.method)
    if method is None:
        return []
    quiet_torchao()
    # torchao: a heavy optional dependency, imported when QAT runs
    # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    weights = method.fake_quantize_config(compress)
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, nn.Linear) and not skipped(n, compress.skip)]
    wanted = set(names)
    quantize_(model, QATConfig(weight_config=weights, step="prepare"), lambda module, name: name in wanted)
    if method.training_settings(compress).learn_scales:
        # the parameters exist before placement (FSDP shards them with the weight); values: below
        modules = dict(model.named_modules())
        for name in names:
            linear = modules[name]
            rows, cols = linear.weight.shape
            linear.weight_fake_quantizer.scale = nn.Parameter(
                torch.empty(
                    rows,
                    method.scale_groups(compress, cols),
                    device=linear.weight.device,
                    dtype=torch.float32,
                )
            )
    return names


@torch.no_grad()
def init_learned_scales(model: nn.Module, device: torch.device) -> int:
    """Give every learned scale (compress.learn_scales) the value the per-step computation would:
    max|w| / ((qmax - qmin) / 2) per group of the weight as it now stands (seeded or model.init_from;
    int4: rounded to bf16, as suite quantize stores it),
    zero points zero on the compute device. Call after the weights are in place, before the optimizer;
    a resumed checkpoint then overwrites the scales. Works on FSDP's row shards (the scale is sharded
    on the same rows as its weight). Returns how many scales were set."""
    count = 0
    for module, quantizer, scale in _learned(model):
        weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        local = scale.to_local() if isinstance(scale, DTensor) else scale
        qmin, qmax = _QVALUE_BOUNDS[quantizer.config.dtype]
        groups = scale.shape[1]  # an empty FSDP shard (more ranks than rows) has no rows to reshape by -1
        grouped = weight.detach().float().reshape(weight.shape[0], groups, weight.shape[1] // groups)
        amax = grouped.abs().amax(dim=-1)
        start = (amax / ((qmax - qmin) / 2)).clamp(min=torch.finfo(torch.float32).eps)
        local.copy_(start.to(_STORED_SCALE[quantizer.config.dtype]))  # int4: at the bf16 value PTQ stores
        quantizer.zero_point = torch.zeros(tuple(scale.shape), dtype=torch.int32, device=device)
        quantizer._initialized = True  # torchao's flag: the scales are set, do not compute them
        count += 1
    return count


def learned_scale_ratios(model: nn.Module, scale_lr: float) -> dict[int, float]:
    """id(learned scale parameter) -> its learning rate as a multiple of optim.lr: compress.scale_lr,
    times 7.5 / ((qmax - qmin) / 2) so that a step moves every grid's scales by the same fraction
    (AdamW steps by ~lr whatever the gradient's size: a step of 1e-4 is 1% of an int4 scale near 0.01)."""
    ratios = {}
    for _, quantizer, scale in _learned(model):
        qmin, qmax = _QVALUE_BOUNDS[quantizer.config.dtype]
        ratios[id(scale)] = scale_lr * 7.5 / ((qmax - qmin) / 2)
    return ratios


def _learned(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module, nn.Parameter]]:
    """(fake-quantized Linear, its weight quantizer, the learned scale) for every learned scale."""
    for module in model.modules():
        quantizer = getattr(module, "weight_fake_quantizer", None)
        scale = getattr(quantizer, "scale", None)
        if isinstance(scale, nn.Parameter):
            yield module, quantizer, scale


_QVALUE_BOUNDS = {torch.int4: (-8, 7), torch.int8: (-128, 127)}
_STORED_SCALE = {torch.int4: torch.bfloat16, torch.int8: torch.float32}  # what the conversion stores
