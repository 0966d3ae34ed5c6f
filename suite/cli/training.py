"""What the training verbs (pretrain, finetune, distill) share in the parent: the base model's
architecture, running here or handing the frozen config to the launcher, converting a QAT run.

The engine (suite.train, suite.launch, suite.compress) is imported inside the functions that use it:
every verb module is imported to list the verbs, and `suite --help` should not load the trainer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from suite.cli.common import _compose, _expand, _report_compression, _say
from suite.config.compose import to_object
from suite.config.errors import ConfigError
from suite.config.validate import world_size
from suite.verb import VERBS


def with_base_model(raw, overrides: list[str], quantized_ok: bool = False):
    """Take the architecture from model.init_from (a suite run/checkpoint or hf:<folder>); an
    architecture key that the command line sets to another value than the base's is refused, and
    the other model keys it sets (how to compute: attention, document_attention, moe_impl, ...) stay.
    `quantized_ok` (finetune): a `suite quantize` checkpoint may be the base (LoRA over it, QLoRA;
    suite.compress.checks.check_quantized_base says what else it needs)."""

    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
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


def with_default_recipe(verb: str, overrides: list[str]) -> list[str]:
    """The verb's default recipe first, unless the command line names one."""
    default = VERBS[verb].default_recipe
    if default is None or any(o.split("=", 1)[0] == "recipe" for o in overrides):
        return overrides
    return [f"recipe={default}", *overrides]


def train(verb: str, cfg, dims, resolved_yaml: str) -> int:
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
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.launch.launcher import inside_worker, launch

        if not inside_worker():
            launch(
                verb,
                resolved_yaml,
                cfg.launch,
                Path(cfg.run.dir),
                device=cfg.train.device,
                preload=VERBS[verb].rank_imports,
            )
            return 0
    return VERBS[verb].in_rank(cfg, dims, resolved_yaml)


def refuse_auto(cfg, verb: str, unplanned: str) -> None:
    """parallel=auto plans pretraining only: the planner does not model LoRA, QLoRA or a teacher
    (`unplanned`: what this verb adds)."""
    if cfg.parallel.auto:
        raise ConfigError(
            f"parallel=auto is for suite pretrain; suite {verb} needs its degrees written out (the planner does "
            f"not model {unplanned}): "
            "e.g. parallel=fsdp, or `suite plan ...` for a layout"
        )


def convert_qat(cfg, code: int, flags: set[str]) -> int:
    """compress=qat-*: once training has ended, its final checkpoint converted to the real quantized
    model in <run.dir>-<method> with `suite quantize`'s code and report (suite.models.qat)."""
    from suite.models.compression import qat_target  # deferred: imports torch (the verb modules stay light)

    method = qat_target(cfg.compress.method)  # the method a training option converts to; None: no QAT
    if code != 0 or method is None:
        return code
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from dataclasses import replace

    from suite.compress.quantize import run_quantize

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


def print_launch(verb: str, overrides: list[str]) -> int:
    """`--print-launch`: the exact command every node of a launch.nnodes job runs (node ranks and the
    rendezvous endpoint filled in); runs nothing. scripts/slurm/suite.sbatch runs these under srun."""
    _, cfg = _compose(with_default_recipe(verb, overrides))  # as the verb composes
    launch = cfg.launch
    if launch.nnodes < 1:
        raise ConfigError(f"launch.nnodes={launch.nnodes} must be a positive integer")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.launch.launcher import node_commands

    host = launch.rdzv_endpoint.rsplit(":", 1)[0]
    if launch.nnodes > 1 and host.startswith(("127.", "localhost")):
        _say(
            f"note: launch.rdzv_endpoint={launch.rdzv_endpoint} is a loopback address, which the other nodes "
            "cannot reach; pass launch.rdzv_endpoint=<node 0's address>:<port>"
        )
    print("\n".join(node_commands(verb, overrides, launch)))
    return 0


def run_method(compose: Callable[[Any], Any], cfg, dims, resolved_yaml: str) -> int:
    """One rank of a training verb: the method `compose(cfg)` builds (its data and components,
    suite.train.components.Method) run by the common trainer."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.train.trainer import Trainer

    Trainer(cfg, dims, resolved_yaml, compose(cfg)).train()
    return 0
