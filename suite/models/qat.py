"""Quantization-aware training (`compress=qat-int4|qat-int8` on `suite pretrain` / `suite finetune`).

Before the model is placed, torchao's QATConfig(step="prepare") swaps every Linear the final
quantization will convert (those not matched by `compress.skip`) for a FakeQuantizedLinear: the
forward rounds its weight to the target grid (int4 in groups of `compress.group_size` along the input,
or int8 per output row: the same schemes `suite quantize` applies on this device), the backward passes
gradients straight through. Parameter names do not change, so placement, checkpoints and resume are
those of any run; at the end the CLI converts the final checkpoint with `suite quantize`'s code into
`<run.dir>-<int4|int8>` (suite.compress). Fake quantization sees whole weights: data parallelism and
FSDP (which gathers the weight before the forward) run it as one process does; tp, pp, cp and ep are
refused for now (suite.compress.checks).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from suite.config.schema import CompressConfig
from suite.models.quantized import quiet_torchao

QAT_METHODS = {"qat-int4": "int4", "qat-int8": "int8"}  # the training option -> the post-training method


def skipped(name: str, patterns: Iterable[str]) -> bool:
    """A module name matched by a compress.skip pattern (fnmatch; a plain name matches itself and
    every module under it)."""
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


def prepare_qat(model: nn.Module, compress: CompressConfig) -> list[str]:
    """Fake-quantize `model`'s Linear layers in place for compress.method qat-*; returns their names
    (none for any other method)."""
    if compress.method not in QAT_METHODS:
        return []
    quiet_torchao()
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerAxis
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    if QAT_METHODS[compress.method] == "int4":
        # the grid suite quantize's int4 stores: symmetric, one bf16 scale per group (with torchao's
        # default derived from IntxWeightOnlyConfig the fake-quantized weights differed from it)
        weights = IntxFakeQuantizeConfig(
            torch.int4, group_size=compress.group_size, is_symmetric=True, scale_precision=torch.bfloat16
        )
    else:
        weights = IntxFakeQuantizeConfig(torch.int8, granularity=PerAxis(0), is_symmetric=True)
    names = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not skipped(n, compress.skip)
    ]
    wanted = set(names)
    quantize_(model, QATConfig(weight_config=weights, step="prepare"), lambda module, name: name in wanted)
    return names
