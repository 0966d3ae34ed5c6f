"""`suite <verb> [key=value ...] [group=option ...]`: a thin dispatcher in front of Hydra's compose API.

Every verb composes the recipe once in this (parent) process, validates it, and either runs here
or hands the frozen config to the elastic launcher when more than one process is asked for.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf

from suite.config.compose import GROUP_NAMES, compose_config, known_options, to_object
from suite.config.errors import ConfigError
from suite.config.validate import validate, world_size

USAGE = """usage: suite <verb> [key=value ...] [group=option ...] [--json]

verbs:
  pretrain   train a language model from scratch (default: gpt-tiny on the embedded corpus)
  prepare    build a tokenizer and packed token shards from text
  generate   sample text from a trained model: suite generate ckpt=<run.dir> prompt="..."
  export     write a Hugging Face folder: suite export ckpt=<run.dir> format=hf out=<dir>
  config     show / list / cp recipes: suite config show recipe=gpt13b

Run `suite <verb> --help` for the keys a verb reads. Every default lives in the recipes;
`suite config list` shows them, `suite config show` prints a resolved config."""

VERB_HELP = {
    "pretrain": """usage: suite pretrain [recipe=NAME|PATH.yaml] [group=option ...] [key=value ...]

Causal-LM pretraining. With no arguments: gpt-tiny on the embedded corpus (built on first use),
on this machine, writing to run.dir (runs/<model.name>). Re-running the same command resumes from
the newest good checkpoint (train.resume=true).

Common keys:
  recipe=gpt-tiny|gpt345m|gpt1.3b|gpt6.7b|gpt13b|gpt175b|llama-tiny|llama2-7b|llama3-8b|./my.yaml
  run.dir=DIR  train.max_steps=N  train.save_every=N  train.log_every=N  train.eval_every=N
  train.seed=N  train.precision=fp32|bf16|fp16  train.resume=true|false  train.compile=true
  parallel.micro_batch_size=N  parallel.global_batch_size=N  parallel.dp/sharding/tp/pp=N
  data.path=DIR  data.seq_len=N  model.num_layers=N  model.hidden_size=N  model.num_heads=N
  model.vocab_size=N  optim.lr=X  launch.nproc_per_node=N  log.wandb=false

Writes: <run.dir>/config.yaml, metrics.jsonl, checkpoints/step_<N>/, tokenizer.json, summary.json""",
    "prepare": """usage: suite prepare [data=OPTION] [data.path=OUT] ['data.sources=[{path: GLOB_OR_DATASET, weight: W}]']

Trains a byte-level BPE tokenizer (data.vocab_size) and writes packed, memory-mapped token shards
(train/val split by data.val_fraction) into data.path. Sources are local .txt/.jsonl/.parquet globs
or `datasets` names, blended by weight. With no sources: the embedded corpus (no network).

Keys: data.path  data.sources  data.vocab_size  data.val_fraction  data.tokenizer  data.cache_dir""",
    "generate": """usage: suite generate ckpt=<run.dir|checkpoint dir> prompt="..." [generate.KEY=VALUE ...] [--json]

Samples text with a KV cache. `prompt=` is short for generate.prompt.
Keys: generate.max_new_tokens  generate.temperature (0 = greedy)  generate.top_k  generate.top_p
      generate.seed""",
    "export": """usage: suite export ckpt=<run.dir|checkpoint dir|hf:folder> [format=hf] [out=DIR] [export.dtype=fp32|bf16|fp16]

Writes a Hugging Face folder (safetensors, config.json, generation_config.json, tokenizer files)
that transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained load with no custom code:
gpt models as GPT-2, llama-family models as Llama (Qwen2 when they use qkv bias).
`format=` and `out=` are short for export.format and export.out (default <run.dir>/export-hf).""",
    "config": """usage: suite config show [overrides...] [--json]   print the resolved config
       suite config list                         list recipes and every config-group option
       suite config cp recipe=NAME DEST.yaml     copy a shipped recipe for editing, then:
                                                 suite pretrain recipe=DEST.yaml""",
}

SHORTCUTS = {"prompt": "generate.prompt", "format": "export.format", "out": "export.out"}


def _split_flags(args: list[str]) -> tuple[list[str], set[str]]:
    flags = {a for a in args if a.startswith("--")}
    return [a for a in args if not a.startswith("--")], flags


def _expand(overrides: list[str]) -> list[str]:
    out = []
    for text in overrides:
        key, sep, value = text.partition("=")
        out.append(f"{SHORTCUTS.get(key, key)}{sep}{value}")
    return out


def _compose(overrides: list[str]):
    raw = compose_config(_expand(overrides))
    return raw, to_object(raw)


def cmd_pretrain(overrides: list[str], flags: set[str]) -> int:
    raw, cfg = _compose(overrides)
    dims = validate(cfg)
    resolved_yaml = OmegaConf.to_yaml(raw)
    from suite.data import ensure_prepared

    ensure_prepared(cfg.data, progress=True)  # once, in the parent, before any worker starts
    if world_size(cfg) > 1:
        from suite.parallel.launcher import inside_worker, launch

        if not inside_worker():
            launch("pretrain", resolved_yaml, cfg.launch, Path(cfg.run.dir))
            return 0
    from suite.train.trainer import Trainer

    Trainer(cfg, dims, resolved_yaml).train()
    return 0


def cmd_prepare(overrides: list[str], flags: set[str]) -> int:
    _, cfg = _compose(overrides)
    from suite.data import ensure_prepared, prepare

    if cfg.data.path and (cfg.data.sources or not Path(cfg.data.path).exists()):
        out = prepare(cfg.data, Path(cfg.data.path).expanduser(), progress=True)
    else:
        out = ensure_prepared(cfg.data, progress=True)
    meta = json.loads((out / "meta.json").read_text())
    if "--json" in flags:
        print(json.dumps({"path": str(out), **meta}))
    else:
        print(
            f"prepared {out}: vocab {meta['vocab_size']}, {meta['num_train_tokens']:,} train tokens, "
            f"{meta['num_val_tokens']:,} validation tokens"
        )
    return 0


def cmd_generate(overrides: list[str], flags: set[str]) -> int:
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError(
            "ckpt is missing; pass ckpt=<run.dir> (or a checkpoint folder), e.g. ckpt=runs/gpt-tiny"
        )
    from suite.infer.generate import generate_from_checkpoint

    text = generate_from_checkpoint(cfg.ckpt, cfg.generate, device=cfg.train.device)
    if "--json" in flags:
        print(json.dumps({"prompt": cfg.generate.prompt, "text": text}))
    else:
        print(cfg.generate.prompt + text)
    return 0


def cmd_export(overrides: list[str], flags: set[str]) -> int:
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError(
            "ckpt is missing; pass ckpt=<run.dir> (or a checkpoint folder), e.g. ckpt=runs/gpt-tiny"
        )
    validate(cfg, needs_data=False)
    import torch

    from suite.export.hf import export_hf
    from suite.infer.generate import load_for_inference

    model, tokenizer, folder = load_for_inference(cfg.ckpt, "cpu")
    out = Path(cfg.export.out) if cfg.export.out else folder.parent.parent / f"export-{cfg.export.format}"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.export.dtype]
    export_hf(model, model.cfg, out, tokenizer, dtype)
    if "--json" in flags:
        print(json.dumps({"out": str(out), "format": cfg.export.format}))
    else:
        print(f"exported {folder} to {out} (load with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_config(overrides: list[str], flags: set[str]) -> int:
    if not overrides:
        raise ConfigError("config needs a subcommand: show, list or cp (see `suite config --help`)")
    sub, rest = overrides[0], overrides[1:]
    if sub == "show":
        raw = compose_config(_expand(rest))
        if "--json" in flags:
            print(json.dumps(OmegaConf.to_container(raw), indent=1))
        else:
            print(OmegaConf.to_yaml(raw), end="")
        return 0
    if sub == "list":
        table = {group: known_options(group) for group in GROUP_NAMES}
        if "--json" in flags:
            print(json.dumps(table, indent=1))
        else:
            for group, options in table.items():
                print(f"{group + ':':11s} {', '.join(options)}")
        return 0
    if sub == "cp":
        names = [a.split("=", 1)[1] for a in rest if a.startswith("recipe=")]
        dests = [a for a in rest if "=" not in a]
        if len(names) != 1 or len(dests) != 1:
            raise ConfigError(
                "config cp needs recipe=NAME and a destination, e.g. suite config cp recipe=gpt13b ./my13b.yaml"
            )
        options = known_options("recipe")
        if names[0] not in options:
            raise ConfigError(f"recipe='{names[0]}' is not a known recipe; known: {', '.join(options)}")
        from suite.config.compose import recipe_search_dirs

        source = next(
            d / "recipe" / f"{names[0]}.yaml"
            for d in recipe_search_dirs()
            if (d / "recipe" / f"{names[0]}.yaml").is_file()
        )
        dest = Path(dests[0])
        if dest.is_dir():
            dest = dest / source.name
        shutil.copyfile(source, dest)
        print(f"copied {source.name} to {dest}; run it with: suite pretrain recipe={dest}")
        return 0
    raise ConfigError(f"config subcommand '{sub}' is unknown; use show, list or cp")


VERBS: dict[str, Callable[[list[str], set[str]], int]] = {
    "pretrain": cmd_pretrain,
    "prepare": cmd_prepare,
    "generate": cmd_generate,
    "export": cmd_export,
    "config": cmd_config,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"error: unknown verb '{verb}'; use one of: {', '.join(VERBS)} (suite --help)", file=sys.stderr)
        return 2
    overrides, flags = _split_flags(rest)
    if flags & {"--help", "-h"} or "-h" in overrides:
        print(VERB_HELP[verb])
        return 0
    unknown = flags - {"--json", "--help"}
    if unknown:
        print(
            f"error: unknown flag {sorted(unknown)[0]} for '{verb}'; flags are --help and --json, "
            "everything else is key=value",
            file=sys.stderr,
        )
        return 2
    try:
        return VERBS[verb](overrides, flags)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code


if __name__ == "__main__":
    sys.exit(main())
