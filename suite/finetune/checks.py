"""The finetune section's checks, run once in the parent (suite.checks) before any process starts."""

from __future__ import annotations

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig


def check_finetune(cfg: SuiteConfig) -> None:
    """The finetune section on its own, before the base model is read (model.init_from must be there)."""
    ft = cfg.finetune
    for key, value, options in (
        ("finetune.method", ft.method, ("full", "lora")),
        ("finetune.data.truncation", ft.data.truncation, ("truncate", "skip")),
        ("finetune.data.on_error", ft.data.on_error, ("skip", "fail")),
    ):
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(options)}")
    if not cfg.model.init_from:
        raise ConfigError(
            "model.init_from is missing; finetuning starts from a base model: model.init_from=runs/gpt-tiny "
            "(a `suite pretrain` run) or model.init_from=hf:<folder>"
        )
    if ft.data.task:
        from suite.data.tasks import get_task

        get_task(ft.data.task)  # a one-line error for an unknown name
        if ft.data.sources:
            raise ConfigError(
                f"finetune.data.task={ft.data.task} and finetune.data.sources are both set; pick one: finetune.data.task=null to train on the sources (the recipe sets a task)"
            )
    elif not ft.data.sources:
        raise ConfigError(
            "finetune.data needs a task or sources: finetune.data.task=reverse-6 or "
            "'finetune.data.sources=[{path: data/chat.jsonl}]'"
        )
    if ft.lora.rank < 1:
        raise ConfigError(f"finetune.lora.rank={ft.lora.rank} must be >= 1; e.g. 8")
    if not 0.0 <= ft.lora.dropout < 1.0:
        raise ConfigError(f"finetune.lora.dropout={ft.lora.dropout} must be in [0, 1)")
    if ft.epochs is not None and ft.epochs <= 0:
        raise ConfigError(f"finetune.epochs={ft.epochs} must be positive (or null: train.max_steps decides)")


def check_finetune_layout(cfg: SuiteConfig, dims) -> None:
    """What finetuning cannot run yet, once the base model's architecture and the degrees are known
    (`dims`: suite.parallel.dims.ParallelDims)."""
    if getattr(cfg.model, "num_experts", 0):
        raise ConfigError(
            f"model.num_experts={cfg.model.num_experts}: finetuning Mixture-of-Experts models is not supported "
            "yet; finetune a dense model"
        )


def check_quantized_base(cfg: SuiteConfig, dims) -> None:
    """Finetuning over a `suite quantize` checkpoint (QLoRA): LoRA adapters over its frozen quantized
    weights, one process (torchao's tensors are not sharded or replicated by the engine)."""
    from suite.sources import ModelSource

    init_from = cfg.model.init_from
    if not init_from or not ModelSource.parse(init_from, "model.init_from").quantized:
        return
    if cfg.finetune.method != "lora":
        raise ConfigError(
            f"model.init_from='{init_from}' is quantized: its int weights cannot be trained; use "
            "finetune.method=lora (adapters over the frozen quantized weights), or the full-precision model"
        )
    from suite.compress.methods import METHODS
    from suite.models.quantized import quantized_info

    method = quantized_info(ModelSource.parse(init_from, "model.init_from").folder).get("method", "")
    if method in METHODS and not METHODS[method].weight_only:
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
    if cfg.compress.method != "none":
        raise ConfigError(
            f"compress={cfg.compress.method} with a quantized model.init_from='{init_from}': it is quantized "
            "already; use compress=none"
        )
