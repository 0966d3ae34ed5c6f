"""The align section's checks, run once in the parent (suite.cli.verbs.align, suite.preflight) before
any process starts; each method's own checks are registered with it (suite.align.register)."""

from __future__ import annotations

from typing import Any

from suite.align import check_method_layout
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.finetune.checks import check_lora

UNSUPPORTED = ("tp", "pp", "cp", "ep")  # the layouts alignment does not run in (its sampler, its pairs)


def _refuse_unsupported(degrees: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        degree = degrees[name]
        if isinstance(degree, int) and degree > 1:
            raise ConfigError(
                f"parallel.{name}={degree}: suite align runs under data parallelism and sharding only "
                f"(parallel.dp, parallel.sharding) for now; parallel.{name}=1"
            )


def check_align(cfg: SuiteConfig) -> None:
    """The align section on its own, before the base model is read (model.init_from must be there).
    tp, pp, cp and ep set to a number are refused here, before the generic layout checks, whose
    advice (e.g. more micro-batches for pp) would not make alignment run."""
    p = cfg.parallel
    _refuse_unsupported({"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep})
    if not cfg.model.init_from:
        raise ConfigError(
            "model.init_from is missing; suite align starts from a finetuned model: "
            "model.init_from=runs/sft-tiny (a `suite finetune` run) or model.init_from=hf:<folder>"
        )
    if cfg.align.lora:
        check_lora(cfg)
        if "output" in cfg.finetune.lora.target_modules:
            targets = [t for t in cfg.finetune.lora.target_modules if t != "output"]
            raise ConfigError(
                f"finetune.lora.target_modules={list(cfg.finetune.lora.target_modules)} adapts the output "
                "head, which suite align applies itself to score tokens; "
                f"finetune.lora.target_modules=[{','.join(targets)}]"
            )
    if cfg.finetune.method != "full":
        raise ConfigError(
            f"finetune.method={cfg.finetune.method} with suite align: adapters are align.lora=true "
            "(with finetune.lora.* shapes); drop finetune.method="
        )


def check_align_layout(cfg: SuiteConfig, dims) -> None:
    """The layouts alignment runs in: data parallelism and sharding (`dims`: ParallelDims), then the
    method's own layout check (GRPO: prompts per rank, no dropout)."""
    if dims is not None:  # a degree 'auto' resolved to more than 1
        _refuse_unsupported({name: getattr(dims, name) for name in UNSUPPORTED})
    check_method_layout(cfg, dims)
