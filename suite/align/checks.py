"""The align section's checks, run once in the parent (suite.cli.verbs.align, suite.preflight) before
any process starts; each method's own checks are registered with it (suite.align.register)."""

from __future__ import annotations

from suite.align import check_method_layout
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.finetune.checks import check_lora


def check_align(cfg: SuiteConfig) -> None:
    """The align section on its own, before the base model is read (model.init_from must be there)."""
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
    check_method_layout(cfg, dims)
    if dims is None:
        return
    unsupported = {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep}
    for name, degree in unsupported.items():
        if degree > 1:
            raise ConfigError(
                f"parallel.{name}={degree}: suite align runs under data parallelism and sharding only "
                f"(parallel.dp, parallel.sharding) for now; parallel.{name}=1"
            )
