"""The compress section's checks, run once in the parent before anything is read or written."""

from __future__ import annotations

from dataclasses import fields

import torch

from suite.compress.methods import linear_plan
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.model_source import ModelSource
from suite.models import build_model
from suite.models.compression import find, for_training, get, is_none, names, post_training
from suite.models.quantized import quantized_info


def check_compress(cfg: SuiteConfig, device: torch.device) -> None:
    """compress.* on its own and against this device (`suite quantize`)."""
    c = cfg.compress
    trained = for_training(c.method)
    if trained is not None:
        raise ConfigError(f"compress.method={c.method!r}: {trained.training_hint()}")
    if post_training(c.method) is None:
        raise ConfigError(
            f"compress.method={c.method!r} is not a quantization method; use one of: {', '.join(names())} "
            "(e.g. suite quantize ckpt=runs/gpt-tiny compress=int8)"
        )
    if get(c.method).needs_cuda and device.type != "cuda":
        raise ConfigError(
            f"compress.method={c.method!r} needs CUDA (torchao's kernels for it); this device is "
            f"{device.type}: use compress=int4 (group-wise int4 that runs on {device.type})"
        )
    for key in ("group_size", "calib_samples", "eval_batches", "decode_tokens"):
        value = getattr(c, key)
        if value < 1:
            raise ConfigError(f"compress.{key}={value} must be a positive integer")
    if c.int8_layers < 0:
        raise ConfigError(f"compress.int8_layers={c.int8_layers} must be >= 0 (0: every layer at int4)")
    if c.int8_layers and "int8_layers" not in {f.name for f in fields(get(c.method).options)}:
        readers = [n for n in names() if "int8_layers" in {f.name for f in fields(get(n).options)}]
        raise ConfigError(
            f"compress.int8_layers={c.int8_layers} is read by compress={'|'.join(readers)} only, not "
            f"compress={c.method}; use compress={readers[0]} or compress.int8_layers=0"
        )
    if c.task_samples < 0:
        raise ConfigError(f"compress.task_samples={c.task_samples} must be >= 0 (0: no task accuracy)")
    if not 0.0 <= c.smoothquant_alpha <= 1.0:
        raise ConfigError(f"compress.smoothquant_alpha={c.smoothquant_alpha} must be in [0, 1], e.g. 0.5")
    if not 0.0 < c.gptq_damp < 1.0:
        raise ConfigError(f"compress.gptq_damp={c.gptq_damp} must be in (0, 1), e.g. 0.01")
    if any(not isinstance(p, str) or not p for p in c.skip):
        raise ConfigError(
            f"compress.skip={list(c.skip)} must be module-name patterns, e.g. '[output, layers.0.*]'"
        )


def check_compress_model(cfg: SuiteConfig, model, targets: list[str], name: str) -> None:
    """What the source's model must allow: int4 groups tile the input width of every Linear quantized."""
    c = cfg.compress
    method = find(c.method)
    if method is None or not method.group_wise:
        return
    modules = dict(model.named_modules())
    widths = sorted({modules[t].in_features for t in targets})
    bad = [w for w in widths if w % c.group_size]
    if bad:
        fits = [g for g in (256, 128, 64, 32, 16, 8) if all(w % g == 0 for w in widths)]
        raise ConfigError(
            f"compress.group_size={c.group_size} does not divide the input width {bad[0]} of {name}'s "
            f"linear layers; use compress.group_size={fits[0] if fits else 1}"
        )


def check_no_compress(cfg: SuiteConfig) -> None:
    """Training and export: a compress method is post-training quantization, run by `suite quantize`;
    only quantization-aware training (qat-*) is a training option."""
    if for_training(cfg.compress.method) is not None:
        return
    if not is_none(cfg.compress.method):
        raise ConfigError(
            f"compress.method={cfg.compress.method!r} is post-training quantization, applied by `suite quantize` "
            f"to a trained model, not here: suite quantize ckpt=<run.dir> compress={cfg.compress.method}"
        )


def refuse_quantized(text: str, key: str, purpose: str) -> None:
    """A quantized checkpoint, or LoRA adapters trained over one (QLoRA), cannot be quantized again,
    exported, pruned, distilled from or trained on as full weights (yet)."""
    source = ModelSource.parse(text, key)
    if source.is_hf:
        return
    if source.quantized:
        method = quantized_info(source.folder).get("method", "?")
        base = quantized_info(source.folder).get("source", "the model it came from")
        raise ConfigError(
            f"{key}='{text}' is already quantized ({method}); {purpose} needs the full-precision model: "
            f"use {key}={base}"
        )
    base = source.quantized_base
    if base is not None:
        raise ConfigError(
            f"{key}='{text}' holds LoRA adapters over the quantized {base.text} (QLoRA), which cannot be "
            f"merged into int weights; {purpose} needs full-precision weights: finetune LoRA over the "
            "full-precision model instead, or use the run with suite eval / suite generate"
        )


def check_compress_option(overrides: list[str]) -> None:
    """A method named in the plan that is not a `suite quantize` option (qat-*: a training option):
    what to use instead, before the recipe group lookup would only list the options."""
    for text in overrides:
        key, _, value = text.partition("=")
        trained = for_training(value)
        if key in ("compress", "compress.method") and trained is not None:
            raise ConfigError(f"{key}={value}: {trained.training_hint()}")


def check_qat_layout(cfg: SuiteConfig, dims) -> None:
    """Quantization-aware training: on pretrain and finetune (full), whole weights per rank (dp, sharding);
    a verb that cannot train with it refuses it in its own layout checks (suite.distill.checks)."""
    method = cfg.compress.method
    if for_training(method) is None:
        return
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(dims, axis) > 1:
            raise ConfigError(
                f"compress={method} with parallel.{axis}={getattr(dims, axis)}: quantization-aware training runs "
                "under dp and sharding so far; set parallel.{axis}=1".replace("{axis}", axis)
            )
    shape_only = build_model(cfg.model, "meta")
    check_compress_model(cfg, shape_only, linear_plan(shape_only, cfg.compress.skip)[0], cfg.model.name)
    if cfg.finetune.method == "lora":
        raise ConfigError(
            f"compress={method} with finetune.method=lora: the adapters would be trained against fake-quantized "
            "base weights that LoRA never changes; use finetune.method=full, or quantize after LoRA (suite quantize)"
        )


def check_quantized_base(cfg: SuiteConfig, dims) -> None:
    """Finetuning over a `suite quantize` checkpoint (QLoRA): LoRA adapters over its frozen quantized
    weights, one process (torchao's tensors are not sharded or replicated by the engine)."""
    init_from = cfg.model.init_from
    if not init_from or not ModelSource.parse(init_from, "model.init_from").quantized:
        return
    if cfg.finetune.method != "lora":
        raise ConfigError(
            f"model.init_from='{init_from}' is quantized: its int weights cannot be trained; use "
            "finetune.method=lora (adapters over the frozen quantized weights), or the full-precision model"
        )
    method = quantized_info(ModelSource.parse(init_from, "model.init_from").folder).get("method", "")
    stored = post_training(method)
    if stored is not None and not stored.weight_only:
        raise ConfigError(
            f"model.init_from='{init_from}' is quantized with {method}, whose int8 activations pass no "
            "gradient to the layers below; LoRA needs a weight-only base: quantize with compress=int8, "
            "int4 or gptq"
        )
    if dims.world_size > 1:
        raise ConfigError(
            f"model.init_from='{init_from}' is quantized: LoRA over it runs in one process; this layout has "
            f"{dims.world_size}: set launch.nproc_per_node=1 and parallel degrees 1"
        )
    if not is_none(cfg.compress.method):
        raise ConfigError(
            f"compress={cfg.compress.method} with a quantized model.init_from='{init_from}': it is quantized "
            "already; use compress=none"
        )
