"""The finetune section's checks, run once in the parent (suite.preflight) before any process starts."""

from __future__ import annotations

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.tasks import get_task
from suite.models.lora import EXPERT_WEIGHTS, EXPERTS_TARGET


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
    check_lora(cfg)
    if ft.epochs is not None and ft.epochs <= 0:
        raise ConfigError(f"finetune.epochs={ft.epochs} must be positive (or null: train.max_steps decides)")


def check_lora(cfg: SuiteConfig) -> None:
    """finetune.lora.*'s values (finetune's and align's adapters)."""
    lora = cfg.finetune.lora
    if lora.rank < 1:
        raise ConfigError(f"finetune.lora.rank={lora.rank} must be >= 1; e.g. 8")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"finetune.lora.dropout={lora.dropout} must be in [0, 1)")


def check_finetune_layout(cfg: SuiteConfig, dims) -> None:
    """What finetuning cannot run, once the base model's architecture and the degrees are known
    (`dims`: suite.parallel.dims.ParallelDims; MoE layouts are the parallel checks')."""

    ft = cfg.finetune
    if ft.method == "lora" and EXPERTS_TARGET in ft.lora.target_modules and not cfg.model.num_experts:
        raise ConfigError(
            f"finetune.lora.target_modules={list(ft.lora.target_modules)} names {EXPERTS_TARGET}, but "
            f"model.init_from={cfg.model.init_from} is dense (model.num_experts=0); drop {EXPERTS_TARGET} "
            "(w1/w2/w3 adapt the MLP)"
        )
    adapts_experts = any(t in (EXPERTS_TARGET, *EXPERT_WEIGHTS) for t in ft.lora.target_modules)
    if ft.method == "lora" and cfg.model.num_experts and adapts_experts and dims is not None and dims.tp > 1:
        raise ConfigError(
            f"finetune.lora.target_modules={list(ft.lora.target_modules)} adapts the experts, whose LoRA "
            f"factors have no split under parallel.tp={dims.tp} yet; adapt attention only "
            "(finetune.lora.target_modules=[wq,wk,wv,wo]) or use parallel.tp=1 (parallel.ep spreads experts)"
        )
