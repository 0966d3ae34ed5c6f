"""`suite distill`: a student trained against a frozen teacher's next-token distribution (and
optionally its hidden states), on pretraining text or chat rows."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from suite.cli.common import _compose
from suite.cli.training import refuse_auto, run_method, train, with_base_model, with_default_recipe
from suite.distill.checks import check_distill, check_distill_layout
from suite.folders import OVERWRITE
from suite.preflight import validate
from suite.verb import RunIdentity, Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    overrides = with_default_recipe("distill", overrides)
    raw, cfg = _compose(overrides)
    refuse_auto(cfg, "distill", "a teacher")
    if cfg.model.init_from:  # a student that starts from a checkpoint (e.g. a pruned teacher)
        raw, cfg = with_base_model(raw, overrides)
    check_distill(cfg)
    reads_corpus = cfg.distill.data == "pretrain"  # else chat rows, read by the trainer
    dims = validate(cfg, needs_data=reads_corpus, layout_checks=VERB.layout_checks)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.data import ensure_prepared
    from suite.parallel.hosting import check_hosting
    from suite.train.run_folder import check_run_folder

    check_hosting(cfg, dims)
    data_dir = ensure_prepared(cfg.data, progress=True) if reads_corpus else None
    check_run_folder(cfg, "distill", data_dir)
    return train("distill", cfg, dims, OmegaConf.to_yaml(raw))


def in_rank(cfg, dims, resolved_yaml: str) -> int:
    """One rank of a distillation run (suite.cli.worker), or the whole run in one process."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.distill.method import compose

    return run_method(compose, cfg, dims, resolved_yaml)


def sources(cfg) -> dict[str, Any]:
    """The student's starting point and the teacher: another teacher is another run."""
    return {"model.init_from": cfg.model.init_from, "distill.teacher": cfg.distill.teacher}


HELP = """usage: suite distill distill.teacher=<run.dir|checkpoint|hf:folder> [recipe=NAME|PATH.yaml] [key=value ...]

Knowledge distillation: the recipe's model (the student; from scratch, or model.init_from=<run>)
trains on the recipe's pretraining data (or chat rows: distill.data=sft) against the frozen teacher's next-token distribution,
mixed with the hard-label loss. Default recipe: distill-gpt-tiny (a half-size gpt-tiny student of
runs/gpt-tiny). The teacher is placed like the student (dp, sharding, tp) and must share its tokenizer.
Layouts: dp, sharding and tp (+sp), MoE students too (pp, cp and ep are not supported yet for distillation).

Common keys:
  distill.teacher=runs/gpt-tiny|hf:DIR  distill.loss=forward_kl|reverse_kl|jsd  distill.temperature=X
  distill.ce_weight=X (hard-label share, 0..1)  distill.chunk_tokens=N  distill.data=pretrain|sft
  distill.hidden_weight=X (hidden-state matching; 0: off)  distill.hidden_loss=cosine|mse
  distill.hidden_schedule=constant|linear (linear: decays to 0 at the last step)
  (sft: finetune.data.task=... or finetune.data.sources=..., as for suite finetune)  model.num_layers=N
  model.hidden_size=N  run.dir=DIR  train.max_steps=N  parallel.dp/sharding/tp=N  launch.nproc_per_node=N

Writes: <run.dir>/config.yaml, metrics.jsonl (loss: the mixed loss; val_loss: the student's
cross-entropy), checkpoints/step_<N>/, tokenizer.json, summary.json

Examples:
  suite distill
  suite distill distill.loss=jsd distill.temperature=2 run.dir=runs/distill-jsd"""


VERB = register(
    Verb(
        name="distill",
        summary="train a smaller student against a frozen teacher: suite distill recipe=distill-gpt-tiny",
        help=HELP,
        run=run,
        unused=("ckpt", "generate", "export", "prune", "eval", "align"),
        hints={
            "ckpt": "drop ckpt= and pass distill.teacher={value} (the teacher), or drop ckpt= and pass "
            "model.init_from={value} (a student that starts from that checkpoint)"
        },
        section="train",
        flags=("--print-launch", OVERWRITE),
        default_recipe="distill-gpt-tiny",
        composes=True,
        in_rank=in_rank,
        layout_checks=(check_distill_layout,),
        rank_imports=("suite.distill.method",),
        run_identity=RunIdentity(sources=sources),
        stage_output="run",
        output_key="run.dir",
    )
)
