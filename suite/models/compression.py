"""The compression methods, one class each, registered by name: what `compress=<name>` means anywhere.

A method says what it needs (calibration data, a CUDA device; a `training_name` when quantization-aware
training can target it), how it transforms a model (`quantize`: its Linear layers, in place), which
torchao config describes the tensors it stores (suite.models.quantized saves and reloads those tensors
as they are; an HF export records the config in TorchAoConfig), which export formats hold it, and the
compress.* keys it reads, as its own frozen dataclass (`options`, built by `settings` from the flat
compress section users type). The training-time half of a method with a `training_name`
(compress=qat-int4 on pretrain / finetune) is the fake quantizer QAT trains with (suite.models.qat) and
the grid on which the conversion stores the learned scales.

The rest of suite asks the registry (`get`, `find`, `for_training`, `names`, ...) and reads the
method's attributes; it never compares a method's name (tests/unit/test_compress_registry.py).
This module sits beside the model (not in suite.compress, the verbs) because training needs it:
suite.train and suite.models.qat look up the QAT half here.
"""

from __future__ import annotations

import fnmatch
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from suite.config.schema import CompressConfig
from suite.models.gptq import Grid, gptq_quantize, int4_grid, int8_grid, sensitivity
from suite.models.quantized import quiet_torchao

NONE = "none"  # compress=none: no compression (the schema's default)
HF = "hf"  # export format=hf: transformers' TorchAoConfig holds the method's torchao tensors

Calibrate = Callable[[nn.Module], None]


def skipped(name: str, patterns: Iterable[str]) -> bool:
    """A module name matched by a compress.skip pattern (fnmatch; a plain name matches itself and
    every module under it)."""
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns)


# each method's own config: the compress.* keys it reads, under the names users type


@dataclass(frozen=True)
class NoOptions:
    """A method with no key of its own."""


@dataclass(frozen=True)
class GroupOptions:
    group_size: int  # weights per int4 scale along the input dimension


@dataclass(frozen=True)
class SmoothQuantOptions:
    calib_samples: int
    smoothquant_alpha: float  # migration strength: 0 none, 1 all onto the weights


@dataclass(frozen=True)
class GptqOptions:
    group_size: int
    calib_samples: int
    gptq_damp: float  # fraction of the mean Hessian diagonal added to it
    int8_layers: int  # the Linear layers most sensitive to int4 kept at int8 (mixed precision)
    symmetric: bool  # int4 zero points 0; false: an integer zero point per group (torchao ASYMMETRIC)
    clip_search: bool  # asymmetric: each group's range shrunk by the factor with the least error
    clip_weighted: bool  # that error weighted by diag H (each input's mean square)
    act_order: bool  # columns rounded in order of decreasing diag H, static groups


@dataclass(frozen=True)
class GptqInt8Options:
    calib_samples: int
    gptq_damp: float
    act_order: bool


@dataclass(frozen=True)
class TrainingOptions:
    """The keys of a method's training-time half (quantization-aware training)."""

    learn_scales: bool  # scales trained with the weights (LSQ), stored by the conversion
    scale_lr: float  # their learning rate as a multiple of optim.lr (read by suite.train.optim)


class CompressionMethod(ABC):
    """One compression method: its facts as class attributes, its behaviour as methods."""

    name: ClassVar[str]  # compress.method / compress=<name> for `suite quantize`
    summary: ClassVar[str]  # one line of `suite quantize --help`
    devices: ClassVar[str] = "CPU, CUDA"
    options: ClassVar[type] = NoOptions  # its config dataclass (fields named as compress.<key>)
    needs_calibration: ClassVar[bool] = False  # runs forwards of the recipe's data before converting
    needs_cuda: ClassVar[bool] = False  # torchao kernels for it exist on CUDA only
    # float activations: gradients reach a layer's input (LoRA over it trains what lies below: QLoRA)
    weight_only: ClassVar[bool] = True
    group_wise: ClassVar[bool] = False  # compress.group_size must tile every quantized input width
    formats: ClassVar[tuple[str, ...]] = (HF,)  # export formats that hold its tensors as they are
    training_name: ClassVar[str | None] = None  # compress=<this> on pretrain/finetune trains for it

    def settings(self, compress: CompressConfig) -> Any:
        """This method's own config, read from the compress section."""
        return self.options(**{f.name: getattr(compress, f.name) for f in fields(self.options)})

    @abstractmethod
    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        """The torchao config that quantizes one Linear on `device`: the type of the tensors stored."""

    def grid(self, compress: CompressConfig) -> Grid | None:
        """The grid on which given integers and scales are stored (GPTQ's, QAT's learned ones); None:
        this method rounds only on its own."""
        return None

    def quantize(
        self,
        model: nn.Module,
        targets: list[str],
        compress: CompressConfig,
        device: torch.device,
        calibrate: Calibrate | None,
    ) -> None:
        """Quantize the Linear layers named `targets` in place (round to nearest, torchao)."""
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization import quantize_

        wanted = set(targets)
        quantize_(model, self.torchao_config(compress, device), lambda m, name: name in wanted)

    # the training-time half (methods with a training_name)

    def fake_quantize_config(self, compress: CompressConfig) -> Any:
        """torchao's fake quantizer of the weights that QAT for this method trains with."""
        raise TypeError(f"compress={self.name} has no quantization-aware training")

    def scale_groups(self, compress: CompressConfig, in_features: int) -> int:
        """Scales per output row of a Linear with `in_features` inputs, on this method's grid."""
        grid = self.grid(compress)
        if grid is None:
            raise TypeError(f"compress={self.name} stores no scales of its own grid")
        return in_features // grid.group if grid.group else 1

    def training_settings(self, compress: CompressConfig) -> TrainingOptions:
        return TrainingOptions(**{f.name: getattr(compress, f.name) for f in fields(TrainingOptions)})

    def training_hint(self) -> str:
        """What to type instead when a training option is given to `suite quantize`."""
        return (
            f"quantization-aware training is a training option: suite finetune compress={self.training_name} "
            f"(or suite pretrain), which converts its final checkpoint to {self.name} itself; "
            f"post-training: compress={self.name}"
        )


M = TypeVar("M", bound=type[CompressionMethod])
_METHODS: dict[str, CompressionMethod] = {}
_TRAINING: dict[str, CompressionMethod] = {}


def register(cls: M) -> M:
    """Class decorator: one instance of `cls` under its name (and its training_name)."""
    method = cls()
    for table, name in ((_METHODS, cls.name), (_TRAINING, cls.training_name)):
        if name is None:
            continue
        if name in _METHODS or name in _TRAINING or name == NONE:
            raise ValueError(f"compression method {name!r} is registered twice")
        table[name] = method
    return cls


def names() -> list[str]:
    """The post-training methods (`suite quantize compress=<name>`), in registration order."""
    return list(_METHODS)


def training_names() -> list[str]:
    """The training options (`suite pretrain|finetune compress=<name>`)."""
    return list(_TRAINING)


def all_names() -> list[str]:
    return names() + training_names()


def get(name: str) -> CompressionMethod:
    """The post-training method `name`; KeyError naming the known ones otherwise."""
    if name not in _METHODS:
        raise KeyError(f"compress.method={name!r} is not a quantization method; known: {', '.join(_METHODS)}")
    return _METHODS[name]


def post_training(name: str) -> CompressionMethod | None:
    return _METHODS.get(name)


def for_training(name: str) -> CompressionMethod | None:
    """The method a training option (qat-*) trains for and converts to; None for any other name."""
    return _TRAINING.get(name)


def find(name: str) -> CompressionMethod | None:
    """The method `name` selects, as a post-training method or as a training option."""
    return _METHODS.get(name) or _TRAINING.get(name)


def is_none(name: str) -> bool:
    """compress=none: nothing to compress."""
    return name == NONE


def qat_target(name: str) -> str | None:
    """The post-training method a training option converts its final checkpoint to, else None."""
    method = for_training(name)
    return method.name if method is not None else None


def exporting(fmt: str) -> list[str]:
    """The methods whose checkpoints export to `fmt` quantized."""
    return [name for name, method in _METHODS.items() if fmt in method.formats]


def help_lines() -> str:
    """`suite quantize --help`'s method table: name, summary, devices."""
    return "\n".join(f"  {m.name:<15s}{m.summary:<63s}  {m.devices}" for m in _METHODS.values())


# the methods


def _learned(compress: CompressConfig) -> dict[str, bool]:
    learn = compress.learn_scales
    return {"is_dynamic": not learn, "range_learning": learn}


@register
class Int8(CompressionMethod):
    """torchao Int8WeightOnlyConfig: int8 weights (one scale per output row), float activations."""

    name = "int8"
    summary = "int8 weights, float activations"
    training_name = "qat-int8"

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        return int8_grid().torchao_config()

    def grid(self, compress: CompressConfig) -> Grid:
        return int8_grid()

    def fake_quantize_config(self, compress: CompressConfig) -> Any:
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization.granularity import PerAxis
        from torchao.quantization.qat import IntxFakeQuantizeConfig

        return IntxFakeQuantizeConfig(
            torch.int8, granularity=PerAxis(0), is_symmetric=True, **_learned(compress)
        )


@register
class W8A8(CompressionMethod):
    """Int8DynamicActivationInt8WeightConfig: int8 weights, activations quantized per token on the fly."""

    name = "w8a8"
    summary = "int8 weights + int8 activations quantized per token at run time"
    weight_only = False

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        return Int8DynamicActivationInt8WeightConfig()


@register
class Int4(CompressionMethod):
    """Group-wise int4 weights: on CPU IntxWeightOnlyConfig (bf16 scales), on CUDA Int4WeightOnlyConfig;
    a QAT run's learned scales are stored on the CPU layout on any device (as GPTQ's)."""

    name = "int4"
    summary = "int4 weights, one bf16 scale per compress.group_size weights"
    options = GroupOptions
    group_wise = True
    training_name = "qat-int4"

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        if device.type == "cuda":
            return Int4Tinygemm().torchao_config(compress, device)
        return self.grid(compress).torchao_config()

    def grid(self, compress: CompressConfig) -> Grid:
        return int4_grid(self.settings(compress).group_size)

    def fake_quantize_config(self, compress: CompressConfig) -> Any:
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization.qat import IntxFakeQuantizeConfig

        # the grid suite quantize's int4 stores: symmetric, one bf16 scale per group (with torchao's
        # default derived from IntxWeightOnlyConfig the fake-quantized weights differed from it); learned
        # scales train in fp32 and are stored in bf16 (within 2^-9 of what training saw)
        precision = torch.float32 if compress.learn_scales else torch.bfloat16
        return IntxFakeQuantizeConfig(
            torch.int4,
            group_size=self.settings(compress).group_size,
            is_symmetric=True,
            scale_precision=precision,
            **_learned(compress),
        )


@register
class Int4Tinygemm(CompressionMethod):
    """Int4WeightOnlyConfig on any device: torchao's tinygemm kernels, CUDA only; its CUDA tensors have
    no HF TorchAoConfig on another machine."""

    name = "int4-tinygemm"
    summary = "int4 with torchao's tinygemm kernels"
    devices = "CUDA only"
    options = GroupOptions
    needs_cuda = True
    group_wise = True
    formats = ()

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=self.settings(compress).group_size)


@register
class SmoothQuant(CompressionMethod):
    """w8a8 after SmoothQuant: activation outliers moved onto the weights, with per-channel scales
    observed on compress.calib_samples sequences of the recipe's data (torchao prototype)."""

    name = "smoothquant"
    summary = "w8a8 after SmoothQuant calibration on compress.calib_samples sequences"
    options = SmoothQuantOptions
    needs_calibration = True
    weight_only = False

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        return W8A8().torchao_config(compress, device)

    def quantize(
        self,
        model: nn.Module,
        targets: list[str],
        compress: CompressConfig,
        device: torch.device,
        calibrate: Calibrate | None,
    ) -> None:
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.prototype.smoothquant import SmoothQuantConfig
        from torchao.quantization import quantize_

        wanted = set(targets)
        base, alpha = self.torchao_config(compress, device), self.settings(compress).smoothquant_alpha
        quantize_(model, SmoothQuantConfig(base, step="prepare", alpha=alpha), lambda m, n: n in wanted)
        if calibrate is not None:
            calibrate(model)
        quantize_(model, SmoothQuantConfig(base, step="convert", alpha=alpha), lambda m, n: n in wanted)


class _Gptq(CompressionMethod):
    """A grid's round to nearest with GPTQ's error compensation on calibration data (suite.models.gptq,
    plain torch: CPU and CUDA); stored as the grid's torchao tensors."""

    needs_calibration = True

    def torchao_config(self, compress: CompressConfig, device: torch.device) -> Any:
        return self.grid(compress).torchao_config()

    def quantize(
        self,
        model: nn.Module,
        targets: list[str],
        compress: CompressConfig,
        device: torch.device,
        calibrate: Calibrate | None,
    ) -> None:
        settings, grid = self.settings(compress), self.grid(compress)
        calibrate = calibrate or (lambda m: None)
        gptq_quantize(
            model,
            targets,
            grid,
            settings.gptq_damp,
            calibrate,
            progress=True,
            int8_layers=self.wide(model, targets, compress, calibrate),
            act_order=settings.act_order,
        )

    def wide(
        self, model: nn.Module, targets: list[str], compress: CompressConfig, calibrate: Calibrate
    ) -> list[str]:
        """The targets kept at int8: none here (a method with an int4 grid measures them)."""
        return []


@register
class Gptq(_Gptq):
    name = "gptq"
    summary = "int4's grid, GPTQ error compensation on compress.calib_samples sequences"
    options = GptqOptions
    group_wise = True

    def grid(self, compress: CompressConfig) -> Grid:
        settings = self.settings(compress)
        return int4_grid(
            settings.group_size, settings.symmetric, settings.clip_search, settings.clip_weighted
        )

    def wide(
        self, model: nn.Module, targets: list[str], compress: CompressConfig, calibrate: Calibrate
    ) -> list[str]:
        """compress.int8_layers Linear layers with the largest relative int4 error on the calibration
        data (suite.models.gptq.sensitivity), named with their error on stderr."""
        count = min(self.settings(compress).int8_layers, len(targets))
        if count <= 0:
            return []
        scores = sensitivity(model, targets, self.grid(compress), calibrate)
        chosen = sorted(targets, key=lambda n: -scores[n])[:count]
        listed = ", ".join(f"{n} {scores[n]:.4f}" for n in chosen)
        print(f"kept at int8 (relative int4 output error on the calibration data): {listed}", file=sys.stderr)
        return chosen


@register
class GptqInt8(_Gptq):
    name = "gptq-int8"
    summary = "int8's grid, GPTQ error compensation"
    options = GptqInt8Options

    def grid(self, compress: CompressConfig) -> Grid:
        return int8_grid()
