"""`suite finetune`: supervised finetuning (full, LoRA, QLoRA over a quantized base) of a suite or
Hugging Face checkpoint, on the pretraining trainer's layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite.cli.common import _compose
from suite.cli.training import (
    convert_qat,
    refuse_auto,
    run_method,
    train,
    with_base_model,
    with_default_recipe,
)
from suite.finetune.checks import check_finetune, check_finetune_layout
from suite.folders import OVERWRITE
from suite.preflight import validate
from suite.verb import RunIdentity, Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    overrides = with_default_recipe("finetune", overrides)
    raw, cfg = _compose(overrides)
    refuse_auto(cfg, "finetune", "a finetuning method")
    check_finetune(cfg)  # before the base model is read (model.init_from must be there)
    raw, cfg = with_base_model(raw, overrides, quantized_ok=True)
    dims = validate(cfg, needs_data=False, layout_checks=VERB.layout_checks)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.compress.checks import check_quantized_base
    from suite.parallel.hosting import check_hosting
    from suite.train.run_folder import check_run_folder

    check_quantized_base(cfg, dims)
    check_hosting(cfg, dims)
    check_run_folder(cfg, "finetune")
    return convert_qat(cfg, train("finetune", cfg, dims, OmegaConf.to_yaml(raw)), flags)


def in_rank(cfg, dims, resolved_yaml: str) -> int:
    """One rank of a finetuning run (suite.cli.worker), or the whole run in one process."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.finetune.method import compose

    return run_method(compose, cfg, dims, resolved_yaml)


def identity_keys(cfg) -> dict[str, Any]:
    """A finetuning run resumes only with its method (and LoRA's shapes)."""
    out: dict[str, Any] = {"finetune.method": cfg.finetune.method}
    if cfg.finetune.method == "lora":
        out["finetune.lora.rank"] = cfg.finetune.lora.rank
        out["finetune.lora.target_modules"] = list(cfg.finetune.lora.target_modules)
    return out


def base_tokenizer(cfg, data_dir: Path | None) -> Path | None:
    """Finetuning trains with its base model's tokenizer (an HF folder's, or the run's it came from)."""
    init = str(cfg.model.init_from or "")
    if not init:
        return None
    if init.startswith("hf:"):
        return Path(init[3:]).expanduser() / "tokenizer.json"
    if init.startswith("gguf:"):  # the tokenizer is the file's metadata: the file stands for it
        return Path(init[5:]).expanduser()
    path = Path(init).expanduser()  # a run folder, or one of its checkpoint folders
    return (
        path / "tokenizer.json"
        if (path / "tokenizer.json").is_file()
        else path.parent.parent / "tokenizer.json"
    )


HELP = """usage: suite finetune [recipe=sft-tiny|PATH.yaml] model.init_from=<run.dir|checkpoint|hf:folder> [key=value ...]

Supervised finetuning with the pretraining trainer (same parallel layouts, recompute, logging,
checkpoints, resume). Default recipe: sft-tiny (gpt-tiny from runs/gpt-tiny on the built-in
reverse-6 task). The base checkpoint gives the architecture and the tokenizer.

Common keys:
  finetune.method=full|lora  finetune.lora.rank=N  finetune.lora.alpha=X  finetune.lora.dropout=X
  'finetune.lora.target_modules=[wq,wk,wv,wo,w1,w2,w3]'  finetune.epochs=X (sets train.max_steps)
  finetune.data.task=reverse-6|sort-6|addition-3  finetune.data.num_train=N  finetune.data.num_eval=N
  finetune.data.task=null 'finetune.data.sources=[{path: data/chat.jsonl}]' (the recipe sets a task;
    a source: .jsonl/.jsonl.gz/.json/.parquet files, a folder or glob of them, a `datasets`
    save_to_disk folder, or a `datasets` name)
  'finetune.data.eval_sources=[{path: ...}]'
  finetune.data.template=auto|chatml|plain|FILE.jinja  finetune.data.packing=true|false
  finetune.data.truncation=truncate|skip  finetune.data.on_error=skip|fail  finetune.eval_samples=N
  run.dir=DIR  train.max_steps=N  train.eval_every=N  optim.lr=X  data.seq_len=N  launch.nproc_per_node=N

Writes: <run.dir>/config.yaml, metrics.jsonl (val_loss, val_accuracy), checkpoints/step_<N>/ (+ lora/),
tokenizer files with the chat template, task/ (a built-in task's train/eval rows), lora/ (LoRA runs)

Examples:
  suite finetune model.init_from=runs/gpt-tiny
  suite finetune recipe=sft-tiny-lora model.init_from=runs/gpt-tiny
  suite finetune model.init_from=runs/gpt-tiny finetune.data.task=null 'finetune.data.sources=[{path: data/chat.jsonl}]' run.dir=runs/sft-chat"""


VERB = register(
    Verb(
        name="finetune",
        summary="supervised finetuning (full or LoRA) of a suite or HF checkpoint: "
        "suite finetune model.init_from=runs/gpt-tiny",
        help=HELP,
        run=run,
        unused=("ckpt", "generate", "export", "prune", "distill", "eval", "align"),
        hints={"ckpt": "finetuning starts from model.init_from: drop ckpt= and pass model.init_from={value}"},
        section="train",
        flags=("--print-launch", OVERWRITE),
        default_recipe="sft-tiny",
        composes=True,
        in_rank=in_rank,
        layout_checks=(check_finetune_layout,),
        rank_imports=("suite.finetune.method",),
        run_identity=RunIdentity(keys=identity_keys, tokenizer=base_tokenizer),
        stage_output="run",
        output_key="run.dir",
    )
)
