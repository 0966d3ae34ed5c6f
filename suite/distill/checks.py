"""The distill section's checks, run once in the parent (suite.cli.verbs.distill, suite.preflight) before
any process starts."""

from __future__ import annotations

from suite.compress.checks import refuse_quantized
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.distill.divergence import DIVERGENCES
from suite.distill.hidden import HIDDEN_LOSSES, HIDDEN_SCHEDULES
from suite.model_source import ModelSource
from suite.models.compression import for_training
from suite.models.transformer import ffn_size


def check_distill(cfg: SuiteConfig) -> None:
    d = cfg.distill
    if not d.teacher:
        raise ConfigError(
            "distill.teacher is missing; distillation needs a frozen teacher: distill.teacher=runs/gpt-tiny "
            "(a `suite pretrain` or `suite finetune` run) or distill.teacher=hf:<folder>"
        )
    if d.loss not in DIVERGENCES:
        raise ConfigError(f"distill.loss={d.loss!r} is not a divergence; use one of {', '.join(DIVERGENCES)}")
    if not d.temperature > 0:
        raise ConfigError(f"distill.temperature={d.temperature} must be > 0; e.g. 1.0 or 2.0")
    if not 0.0 <= d.ce_weight <= 1.0:
        raise ConfigError(
            f"distill.ce_weight={d.ce_weight} must be in [0, 1] (the hard-label share of the loss); e.g. 0.5"
        )
    if d.data not in ("pretrain", "sft"):
        raise ConfigError(
            f"distill.data={d.data!r} is not a data kind; use pretrain (data.*) or sft (finetune.data)"
        )
    if d.data == "sft":
        if cfg.finetune.method != "full":
            raise ConfigError(
                f"finetune.method={cfg.finetune.method} with suite distill: the student trains all its weights; "
                "set finetune.method=full"
            )
        if not (cfg.finetune.data.task or cfg.finetune.data.sources):
            raise ConfigError(
                "distill.data=sft needs chat rows: finetune.data.task=reverse-6 or "
                "'finetune.data.sources=[{path: data/chat.jsonl}]'"
            )
    if not d.hidden_weight >= 0 or d.hidden_weight == float("inf"):
        raise ConfigError(
            f"distill.hidden_weight={d.hidden_weight} must be >= 0 (0: no hidden-state matching); e.g. 1.0"
        )
    if d.hidden_schedule not in HIDDEN_SCHEDULES:
        raise ConfigError(
            f"distill.hidden_schedule={d.hidden_schedule!r} is not a schedule; use one of {', '.join(HIDDEN_SCHEDULES)}"
        )
    if d.hidden_loss not in HIDDEN_LOSSES:
        raise ConfigError(
            f"distill.hidden_loss={d.hidden_loss!r} is not a hidden-state loss; use one of {', '.join(HIDDEN_LOSSES)}"
        )
    if d.chunk_tokens < 1:
        raise ConfigError(f"distill.chunk_tokens={d.chunk_tokens} must be >= 1; e.g. 1024")
    refuse_quantized(d.teacher, "distill.teacher", "distilling from it")  # `suite quantize` output
    teacher = ModelSource.parse(d.teacher, "distill.teacher")  # one line when missing or corrupt
    vocab = teacher.model_config().vocab_size
    if vocab != cfg.model.vocab_size:
        raise ConfigError(
            f"distill.teacher='{d.teacher}' has model.vocab_size={vocab} but the student has "
            f"model.vocab_size={cfg.model.vocab_size}; teacher and student must share the tokenizer and vocabulary"
        )


def check_distill_layout(cfg: SuiteConfig, dims) -> None:
    """What distillation cannot run yet, once the degrees are known (`dims`: ParallelDims); under tp
    the teacher is split like the student, so its widths must divide too. Under pp the loss runs on
    the last stage with a whole teacher there (suite.distill.step_loss): no tp beside it (the teacher would
    need the tp plans of a stage it is not), and no hidden-state matching (the student's matched blocks
    live on other stages than the loss)."""
    for axis in ("cp", "ep"):
        if getattr(dims, axis) > 1:
            raise ConfigError(
                f"parallel.{axis}={getattr(dims, axis)}: distillation runs under dp, sharding, tp (+sp) and pp "
                f"only so far; set parallel.{axis}=1"
            )
    if dims.pp > 1 and dims.tp > 1:
        raise ConfigError(
            f"parallel.pp={dims.pp} with parallel.tp={dims.tp}: distillation under pipeline parallelism holds "
            "a whole teacher on the last stage; set parallel.tp=1 (or parallel.pp=1)"
        )
    if dims.pp > 1 and cfg.distill.hidden_weight:
        raise ConfigError(
            f"distill.hidden_weight={cfg.distill.hidden_weight} with parallel.pp={dims.pp}: hidden-state matching "
            "runs under dp, sharding and tp (+sp) only: the matched student blocks live on other stages than "
            "the loss; set distill.hidden_weight=0 or parallel.pp=1"
        )
    if dims.tp > 1 and cfg.distill.teacher:
        teacher = ModelSource.parse(cfg.distill.teacher, "distill.teacher").model_config()
        kv = teacher.num_kv_heads or teacher.num_heads
        for key, size in (
            ("model.num_heads", teacher.num_heads),
            ("model.num_kv_heads", kv),
            ("model.ffn_hidden_size", ffn_size(teacher)),
        ):
            if size % dims.tp:
                raise ConfigError(
                    f"parallel.tp={dims.tp} does not divide the teacher's {key}={size} (distill.teacher="
                    f"'{cfg.distill.teacher}'); the teacher is split like the student: use a tp that divides {size}"
                )
    if for_training(cfg.compress.method) is not None:
        raise ConfigError(
            f"compress={cfg.compress.method} is a training option of suite pretrain and suite finetune, not distill"
        )
