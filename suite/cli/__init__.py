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

from suite.cli.common import _compose, _compose_with_ckpt, _expand, _report, _say
from suite.cli.help import USAGE, verb_help
from suite.cli.infer import cmd_chat, cmd_eval, cmd_export, cmd_generate
from suite.cli.report import cmd_report
from suite.config.compose import GROUP_NAMES, compose_config, known_options, to_object
from suite.config.errors import ConfigError
from suite.config.validate import world_size
from suite.folders import OVERWRITE
from suite.output_paths import check_new_file
from suite.pipeline import cmd_run
from suite.preflight import validate
from suite.runtime import resolve_auto

BIG_MODEL = 100e6  # parameters: pretraining such a model on the embedded corpus gets a note


def _split_flags(args: list[str]) -> tuple[list[str], set[str]]:
    flags = {a for a in args if a.startswith("--")}
    return [a for a in args if not a.startswith("--")], flags


def cmd_pretrain(overrides: list[str], flags: set[str]) -> int:
    raw, cfg = _compose(overrides)
    if cfg.model.init_from:  # continued pretraining: the architecture and weights of a checkpoint
        raw, cfg = _with_base_model(raw, overrides)
    choice = None
    if cfg.parallel.auto:  # the planner picks the layout for this launch (suite.plan.auto)
        from suite.plan.auto import choose_layout

        choice = choose_layout(raw, here="--dry-run" not in flags)
        raw, cfg = choice.raw, choice.cfg
    if "--dry-run" in flags:
        if choice is not None:
            _say(choice.line("not written by a dry run (`suite plan` prints it)"))
        return _dry_run(cfg, flags)
    dims = validate(cfg)
    from suite.parallel.hosting import check_hosting
    from suite.plan.fit import check_fits

    check_fits(cfg, dims, _expand(overrides))  # nothing allocated yet: a recipe that cannot fit stops here
    estimate = check_hosting(cfg, dims)  # before the data is prepared: a cluster recipe stops here
    if not cfg.data.path and estimate.params > BIG_MODEL:
        _say(
            f"note: data.path is not set, so {cfg.model.name} pretrains on the small embedded corpus "
            "(Python docstrings); prepare your text with `suite prepare data.path=DIR ...` and pass data.path=DIR"
        )
    resolved_yaml = OmegaConf.to_yaml(raw)
    from suite.data import ensure_prepared
    from suite.train.run_folder import check_run_folder

    data_dir = ensure_prepared(cfg.data, progress=True)  # once, in the parent, before any worker starts
    check_run_folder(cfg, "pretrain", data_dir)  # refuses, writing nothing, or moves an old run aside
    if choice is not None:
        print(choice.line(str(choice.write(cfg.run.dir))), flush=True)
    return _convert_qat(cfg, _train("pretrain", cfg, dims, resolved_yaml), flags)


def _dry_run(cfg, flags: set[str]) -> int:
    """`--dry-run [--rank N|worst]`: one rank of the full job placed on the meta device under a fake
    process group (suite.plan.dryrun); no data, no run folder, no memory check: a laptop can do it."""
    dims = validate(cfg, needs_data=False, writes_run=False)
    from suite.plan.dryrun import dry_run, report, worst_rank

    which = next((f.split("=", 1)[1] for f in flags if f.startswith("--rank=")), "worst")
    if which == "worst":
        rank = worst_rank(cfg, dims)
    else:
        try:
            rank = int(which)
        except ValueError:
            raise ConfigError(
                f"--rank {which} is not a rank; use a number 0..{dims.world_size - 1} or worst"
            ) from None
    result = dry_run(cfg, dims, rank)
    return _report(flags, result, report(result))


def _train(verb: str, cfg, dims, resolved_yaml: str) -> int:
    """`_run_training`, leaving no empty run folder behind when a check inside the trainer refuses."""
    run_dir = Path(cfg.run.dir).expanduser().absolute()
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        return _run_training(verb, cfg, dims, resolved_yaml)
    except ConfigError:
        for folder in missing:  # innermost first; one that holds anything stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _run_training(verb: str, cfg, dims, resolved_yaml: str) -> int:
    """Train here, or hand the frozen config to the elastic launcher when more processes are asked for."""
    if world_size(cfg) > 1:
        from suite.launch.launcher import inside_worker, launch

        if not inside_worker():
            launch(verb, resolved_yaml, cfg.launch, Path(cfg.run.dir), device=cfg.train.device)
            return 0
    from suite.cli.worker import run_trainer

    return run_trainer(verb, cfg, dims, resolved_yaml)


def cmd_distill(overrides: list[str], flags: set[str]) -> int:
    if not any(o.split("=", 1)[0] == "recipe" for o in overrides):
        overrides = ["recipe=distill-gpt-tiny", *overrides]
    raw, cfg = _compose(overrides)
    _refuse_auto(cfg, "distill")
    from suite.distill.checks import check_distill

    if cfg.model.init_from:  # a student that starts from a checkpoint (e.g. a pruned teacher)
        raw, cfg = _with_base_model(raw, overrides)
    check_distill(cfg)
    dims = validate(cfg, needs_data=cfg.distill.data == "pretrain", distill=True)
    from suite.data import ensure_prepared
    from suite.parallel.hosting import check_hosting
    from suite.train.run_folder import check_run_folder

    check_hosting(cfg, dims)
    data_dir = ensure_prepared(cfg.data, progress=True) if cfg.distill.data == "pretrain" else None
    check_run_folder(cfg, "distill", data_dir)
    return _train("distill", cfg, dims, OmegaConf.to_yaml(raw))


def _refuse_auto(cfg, verb: str) -> None:
    """parallel=auto plans pretraining only: the planner does not model LoRA, QLoRA or a teacher."""
    if cfg.parallel.auto:
        raise ConfigError(
            f"parallel=auto is for suite pretrain; suite {verb} needs its degrees written out (the planner does "
            f"not model a {'teacher' if verb == 'distill' else 'finetuning method'}): "
            "e.g. parallel=fsdp, or `suite plan ...` for a layout"
        )


def _with_base_model(raw, overrides: list[str], quantized_ok: bool = False):
    """Take the architecture from model.init_from (a suite run/checkpoint or hf:<folder>); an
    architecture key that the command line sets to another value than the base's is refused, and
    the other model keys it sets (how to compute: attention, document_attention, moe_impl, ...) stay.
    `quantized_ok` (finetune): a `suite quantize` checkpoint may be the base (LoRA over it, QLoRA;
    suite.compress.checks.check_quantized_base says what else it needs)."""
    from dataclasses import asdict

    from suite.compress.checks import refuse_quantized
    from suite.model_source import ModelSource
    from suite.train.run_folder import ARCHITECTURE

    init_from = raw.model.init_from
    source = ModelSource.parse(init_from, "model.init_from")
    if not (quantized_ok and source.quantized):
        refuse_quantized(init_from, "model.init_from", "training from it")
    base = asdict(source.model_config())
    base["init_from"] = init_from
    if source.is_hf:  # a weight layout, not architecture: an HF base is fused on load
        base["fused_projections"] = bool(raw.model.get("fused_projections", False))
    typed = {o.split("=", 1)[0].removeprefix("model.") for o in _expand(overrides) if o.startswith("model.")}
    for key in ARCHITECTURE:
        if key in typed and raw.model.get(key) != base[key]:
            raise ConfigError(
                f"model.{key}={raw.model.get(key)} conflicts with model.init_from={init_from}, whose "
                f"model.{key} is {base[key]}: the architecture comes from init_from; drop model.{key}, "
                "or leave out model.init_from to train a new model"
            )
    print(source.describe(), flush=True)  # training verbs report on stdout
    for key, value in base.items():
        if key in ARCHITECTURE or key not in typed:
            raw.model[key] = value
    return raw, to_object(raw)


def cmd_finetune(overrides: list[str], flags: set[str]) -> int:
    if not any(o.split("=", 1)[0] == "recipe" for o in overrides):
        overrides = ["recipe=sft-tiny", *overrides]
    raw, cfg = _compose(overrides)
    _refuse_auto(cfg, "finetune")
    from suite.finetune.checks import check_finetune

    check_finetune(cfg)  # before the base model is read (model.init_from must be there)
    raw, cfg = _with_base_model(raw, overrides, quantized_ok=True)
    dims = validate(cfg, needs_data=False, finetune=True)
    from suite.compress.checks import check_quantized_base

    check_quantized_base(cfg, dims)
    from suite.parallel.hosting import check_hosting
    from suite.train.run_folder import check_run_folder

    check_hosting(cfg, dims)
    check_run_folder(cfg, "finetune")
    return _convert_qat(cfg, _train("finetune", cfg, dims, OmegaConf.to_yaml(raw)), flags)


def _convert_qat(cfg, code: int, flags: set[str]) -> int:
    """compress=qat-*: once training has ended, its final checkpoint converted to the real quantized
    model in <run.dir>-<method> with `suite quantize`'s code and report (suite.models.qat)."""
    from suite.models.qat import QAT_METHODS

    if code != 0 or cfg.compress.method not in QAT_METHODS:
        return code
    from dataclasses import replace

    from suite.compress.quantize import run_quantize

    method = QAT_METHODS[cfg.compress.method]
    out = f"{str(cfg.run.dir).rstrip('/')}-{method}"
    # the conversion belongs to the run: after the run trained on, the older conversion is moved aside
    qcfg = replace(
        cfg,
        ckpt=cfg.run.dir,
        compress=replace(cfg.compress, method=method),
        run=replace(cfg.run, dir=out),
        train=replace(cfg.train, overwrite=True),
    )
    return _report_compression(run_quantize(qcfg, True), f"quantization-aware {method}", flags)


def cmd_prepare(overrides: list[str], flags: set[str]) -> int:
    _, cfg = _compose(overrides)
    from suite.data import ensure_prepared, prepare
    from suite.data.checks import check_prepare

    check_prepare(cfg)

    if cfg.data.path and (cfg.data.sources or not Path(cfg.data.path).exists()):
        out = prepare(cfg.data, Path(cfg.data.path).expanduser(), progress=True, summary=False)
    else:
        out = ensure_prepared(cfg.data, progress=True, summary=False)
    meta = json.loads((out / "meta.json").read_text())
    return _report(
        flags,
        {"path": str(out), **meta},
        f"prepared {out}: vocab {meta['vocab_size']}, {meta['num_train_tokens']:,} train tokens, "
        f"{meta['num_val_tokens']:,} validation tokens",
    )


def _report_compression(report: dict, what: str, flags: set[str]) -> int:
    """A compression verb's result: its before/after table, where it wrote, the report file."""
    text = f"{report['table']}\n{what} checkpoint: {report['checkpoint']}\nreport: {report['report']}"
    return _report(flags, {k: v for k, v in report.items() if k != "table"}, text)


def _explicit_dir(overrides: list[str]) -> bool:
    return any(o.split("=", 1)[0] == "run.dir" for o in overrides)


def cmd_quantize(overrides: list[str], flags: set[str]) -> int:
    from suite.compress.checks import check_compress_option

    check_compress_option(overrides)  # a method that is not built yet: named before composing
    cfg, _ = _compose_with_ckpt(overrides, "runs/gpt-tiny compress=int8")
    from suite.compress.quantize import run_quantize

    report = run_quantize(cfg, _explicit_dir(overrides))
    return _report_compression(report, report["method"], flags)


def cmd_prune(overrides: list[str], flags: set[str]) -> int:
    cfg, _ = _compose_with_ckpt(overrides, "runs/gpt-tiny prune.ffn=0.25")
    from suite.compress.prune import run_prune

    return _report_compression(run_prune(cfg, _explicit_dir(overrides)), "pruned", flags)


def cmd_config(overrides: list[str], flags: set[str]) -> int:
    if not overrides:
        raise ConfigError("config needs a subcommand: show, list or cp (see `suite config --help`)")
    sub, rest = overrides[0], overrides[1:]
    if sub == "show":
        raw = resolve_auto(compose_config(_expand(rest)))
        if "--json" in flags:
            print(json.dumps(OmegaConf.to_container(raw), indent=1))
        else:
            print(OmegaConf.to_yaml(raw), end="")
        return 0
    if sub == "list":
        if rest:
            raise ConfigError(f"config list takes no arguments (got '{rest[0]}'); use config show {rest[0]}")
        table = {group: known_options(group) for group in (*GROUP_NAMES, "pipeline")}
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
        check_new_file(
            "config cp destination", str(dest), "choose a new file name (your edits stay untouched)"
        )
        shutil.copyfile(source, dest)
        print(f"copied {source.name} to {dest}; run it with: suite pretrain recipe={dest}")
        return 0
    raise ConfigError(f"config subcommand '{sub}' is unknown; use show, list or cp")


def cmd_plan(overrides: list[str], flags: set[str]) -> int:
    """The cost model's ranked layouts for the recipe on the cluster group (suite/plan/): composed
    without resolve_auto, whose answers are this machine's, not the cluster's."""
    cfg = to_object(compose_config(_expand(overrides)))
    explain = next((f.split("=", 1)[1] for f in flags if f.startswith("--explain=")), None)
    from suite.plan.command import run_plan

    result, text = run_plan(cfg, explain)
    return _report(flags, result, text)


def _take_valued_flags(verb: str, args: list[str]) -> list[str]:
    """`--explain LAYOUT` (suite plan), `--rank N` (suite pretrain --dry-run) as one `--flag=VALUE`
    argument; other arguments unchanged."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in VALUED_FLAGS.get(verb, ()):
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{args[i]} needs a value, e.g. {VALUE_EXAMPLES[args[i]]}")
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


VERBS: dict[str, Callable[[list[str], set[str]], int]] = {
    "pretrain": cmd_pretrain,
    "finetune": cmd_finetune,
    "distill": cmd_distill,
    "prune": cmd_prune,
    "eval": cmd_eval,
    "prepare": cmd_prepare,
    "generate": cmd_generate,
    "export": cmd_export,
    "chat": cmd_chat,
    "quantize": cmd_quantize,
    "config": cmd_config,
    "plan": cmd_plan,
    "report": cmd_report,
    "run": cmd_run,
}
VALUED_FLAGS = {"plan": ("--explain",), "pretrain": ("--rank",), "run": ("--from", "--only")}
VALUE_EXAMPLES = {
    "--explain": "--explain dp4-tp8sp-pp12-mb1-full",
    "--rank": "--rank 0 (or --rank worst)",
    "--from": "--from int8 (a stage name)",
    "--only": "--only eval-sft (a stage name)",
}
BOOL_FLAGS = {
    "pretrain": ("--dry-run", "--print-launch", OVERWRITE),
    "finetune": ("--print-launch", OVERWRITE),
    "distill": ("--print-launch", OVERWRITE),
    "quantize": (OVERWRITE,),
    "prune": (OVERWRITE,),
    "export": (OVERWRITE,),
    "report": (OVERWRITE,),
    "run": (OVERWRITE,),
}
# --overwrite: the one switch of every verb that writes a folder (suite.folders); the verbs that compose a
# config read it as train.overwrite=true, report and run (which compose none) as the flag
COMPOSES = ("pretrain", "finetune", "distill", "quantize", "prune", "export")


def _print_launch(verb: str, overrides: list[str]) -> int:
    """`--print-launch`: the exact command every node of a launch.nnodes job runs (node ranks and the
    rendezvous endpoint filled in); runs nothing. scripts/slurm/suite.sbatch runs these under srun."""
    default = {"finetune": "recipe=sft-tiny", "distill": "recipe=distill-gpt-tiny"}.get(verb)
    typed_recipe = any(o.split("=", 1)[0] == "recipe" for o in overrides)
    _, cfg = _compose(
        overrides if typed_recipe or not default else [default, *overrides]
    )  # as the verb composes
    launch = cfg.launch
    if launch.nnodes < 1:
        raise ConfigError(f"launch.nnodes={launch.nnodes} must be a positive integer")
    from suite.launch.launcher import node_commands

    host = launch.rdzv_endpoint.rsplit(":", 1)[0]
    if launch.nnodes > 1 and host.startswith(("127.", "localhost")):
        _say(
            f"note: launch.rdzv_endpoint={launch.rdzv_endpoint} is a loopback address, which the other nodes "
            "cannot reach; pass launch.rdzv_endpoint=<node 0's address>:<port>"
        )
    print("\n".join(node_commands(verb, overrides, launch)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"error: unknown verb '{verb}'; use one of: {', '.join(VERBS)} (suite --help)", file=sys.stderr)
        return 2
    try:
        rest = _take_valued_flags(verb, rest)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    overrides, flags = _split_flags(rest)
    if flags & {"--help", "-h"} or "-h" in overrides:
        print(verb_help(verb))
        return 0
    valued = VALUED_FLAGS.get(verb, ())
    known = {"--json", "--help", *BOOL_FLAGS.get(verb, ())}
    unknown = {f for f in flags - known if f.split("=", 1)[0] not in valued}
    if unknown:
        extra = "".join(f", {v}" for v in BOOL_FLAGS.get(verb, ())) + "".join(f", {v} VALUE" for v in valued)
        print(
            f"error: unknown flag {sorted(unknown)[0]} for '{verb}'; flags are --help and --json{extra}, "
            "everything else is key=value",
            file=sys.stderr,
        )
        return 2
    if OVERWRITE in flags and verb in COMPOSES:
        overrides = [*overrides, "train.overwrite=true"]
    try:
        if "--print-launch" in flags:
            return _print_launch(verb, overrides)
        return VERBS[verb](overrides, flags)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code


if __name__ == "__main__":
    sys.exit(main())
