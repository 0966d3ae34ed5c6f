"""`suite align`: preference tuning (DPO, SimPO) or reinforcement learning with rewards (GRPO) of a
finetuned model, on the common trainer's layouts. The methods are registered by name in suite/align/."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from suite.cli.common import _compose
from suite.cli.training import refuse_auto, run_method, train, with_base_model, with_default_recipe
from suite.cli.verbs.finetune import base_tokenizer  # alignment trains with its base's tokenizer
from suite.folders import OVERWRITE
from suite.verb import RunIdentity, Verb, deferred, register


def run(overrides: list[str], flags: set[str]) -> int:
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.align import check_method
    from suite.align.checks import check_align
    from suite.preflight import validate

    overrides = with_default_recipe("align", overrides)
    raw, cfg = _compose(overrides)
    refuse_auto(cfg, "align", "a reference model")
    check_method(cfg)  # a registered align.method, and its own keys
    check_align(cfg)  # before the base model is read (model.init_from must be there)
    raw, cfg = with_base_model(raw, overrides)
    dims = validate(cfg, needs_data=False, layout_checks=VERB.layout_checks)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.parallel.hosting import check_hosting
    from suite.train.run_folder import check_run_folder

    check_hosting(cfg, dims)
    check_run_folder(cfg, "align")
    return train("align", cfg, dims, OmegaConf.to_yaml(raw))


def in_rank(cfg, dims, resolved_yaml: str) -> int:
    """One rank of an alignment run (suite.cli.worker), or the whole run in one process."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.align import method

    return run_method(method(cfg.align.method), cfg, dims, resolved_yaml)


def identity_keys(cfg) -> dict[str, Any]:
    """An alignment run resumes only with its method, its data, its adapters' shapes and what the
    method says defines its run (suite.align.identity: GRPO's task, group and reward)."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.align import identity

    out: dict[str, Any] = {
        "align.method": cfg.align.method,
        "align.data": cfg.align.data,
        "align.lora": cfg.align.lora,
    }
    if cfg.align.lora:
        out["finetune.lora.rank"] = cfg.finetune.lora.rank
        out["finetune.lora.target_modules"] = list(cfg.finetune.lora.target_modules)
    return out | identity(cfg)


HELP = """usage: suite align [recipe=dpo-tiny|PATH.yaml] model.init_from=<run.dir|checkpoint|hf:folder> align.method=dpo|simpo|grpo [key=value ...]

Post-training of a finetuned model with the common trainer (parallel.dp and parallel.sharding,
recompute, logging, checkpoints, resume). Default recipe: dpo-tiny (DPO of runs/sft-tiny on reverse-6 pairs).
The base checkpoint gives the architecture, the tokenizer and its chat template; under DPO it is also
the frozen reference (placed and sharded like the policy; with align.lora=true the policy with its
adapters off, no second copy).

Common keys:
  align.method=dpo|simpo|grpo  align.data=FILE|FOLDER (pairs: .jsonl/.json/.parquet rows of
    prompt/chosen/rejected as strings or chat messages, or a `datasets` save_to_disk folder)
  align.data=task:reverse-6 align.num_pairs=N (a built-in task: right answers vs corrupted ones)
  align.beta=X  align.label_smoothing=X (dpo)  align.simpo_beta=X  align.simpo_gamma=X (simpo)
  align.num_eval=N (pairs held out: val_loss is their chosen responses' cross-entropy)
  align.lora=true (adapters of finetune.lora.rank/alpha/dropout/target_modules)
  grpo: finetune.data.task=NAME (the prompts) align.grpo.group_size=G align.grpo.prompts_per_step=N
    align.grpo.temperature=X align.grpo.top_p=X align.grpo.reward=exact|format|module:function
    align.grpo.kl_coef=X align.grpo.clip_eps=X align.grpo.updates_per_batch=N (docs/grpo.md)
  finetune.data.template=auto|chatml|plain|FILE.jinja  data.seq_len=N (the longest conversation)
  run.dir=DIR  train.max_steps=N  optim.lr=X  parallel.dp/sharding=N  launch.nproc_per_node=N

Writes: <run.dir>/config.yaml, metrics.jsonl (loss, rewards/chosen, rewards/rejected, rewards/margin,
rewards/accuracy; val_loss, val_rewards/accuracy, val_rewards/margin), checkpoints/step_<N>/ (+ lora/), tokenizer files, lora/ (align.lora=true)

Examples:
  suite align model.init_from=runs/sft-tiny align.data=data/pairs.jsonl
  suite config show recipe=dpo-tiny align.method=simpo align.lora=true     # what a SimPO run with adapters would use"""


VERB = register(
    Verb(
        name="align",
        summary="preference tuning (DPO, SimPO) or GRPO of a finetuned model: "
        "suite align model.init_from=runs/sft-tiny align.data=pairs.jsonl",
        help=HELP,
        run=run,
        unused=("ckpt", "generate", "export", "prune", "distill", "eval"),
        hints={"ckpt": "alignment starts from model.init_from: drop ckpt= and pass model.init_from={value}"},
        section="train",
        flags=("--print-launch", OVERWRITE),
        default_recipe="dpo-tiny",
        composes=True,
        in_rank=in_rank,
        layout_checks=(deferred("suite.align.checks:check_align_layout"),),
        rank_imports=("suite.align.preference",),
        run_identity=RunIdentity(keys=identity_keys, tokenizer=base_tokenizer),
        stage_output="run",
        output_key="run.dir",
    )
)
