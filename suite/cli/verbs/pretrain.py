"""`suite pretrain`: causal-LM pretraining, from scratch or continued (model.init_from), with the
planner's layout (parallel=auto) or a dry run of one rank on the meta device."""

from __future__ import annotations

from omegaconf import OmegaConf

from suite.cli.common import _compose, _expand, _report, _say
from suite.cli.training import convert_qat, run_method, train, with_base_model
from suite.config.errors import ConfigError
from suite.folders import OVERWRITE
from suite.preflight import validate
from suite.verb import RunIdentity, Verb, register

BIG_MODEL = 100e6  # parameters: pretraining such a model on the embedded corpus gets a note


def run(overrides: list[str], flags: set[str]) -> int:
    raw, cfg = _compose(overrides)
    if cfg.model.init_from:  # continued pretraining: the architecture and weights of a checkpoint
        raw, cfg = with_base_model(raw, overrides)
    choice = None
    if cfg.parallel.auto:  # the planner picks the layout for this launch (suite.plan.auto)
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.plan.auto import choose_layout

        choice = choose_layout(raw, here="--dry-run" not in flags)
        raw, cfg = choice.raw, choice.cfg
    if "--dry-run" in flags:
        if choice is not None:
            _say(choice.line("not written by a dry run (`suite plan` prints it)"))
        return _dry_run(cfg, flags)
    dims = validate(cfg)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.data import ensure_prepared
    from suite.parallel.hosting import check_hosting
    from suite.plan.fit import check_fits
    from suite.train.run_folder import check_run_folder

    check_fits(cfg, dims, _expand(overrides))  # nothing allocated yet: a recipe that cannot fit stops here
    estimate = check_hosting(cfg, dims)  # before the data is prepared: a cluster recipe stops here
    if not cfg.data.path and estimate.params > BIG_MODEL:
        _say(
            f"note: data.path is not set, so {cfg.model.name} pretrains on the small embedded corpus "
            "(Python docstrings); prepare your text with `suite prepare data.path=DIR ...` and pass data.path=DIR"
        )
    resolved_yaml = OmegaConf.to_yaml(raw)

    data_dir = ensure_prepared(cfg.data, progress=True)  # once, in the parent, before any worker starts
    check_run_folder(cfg, "pretrain", data_dir)  # refuses, writing nothing, or moves an old run aside
    if choice is not None:
        print(choice.line(str(choice.write(cfg.run.dir))), flush=True)
    return convert_qat(cfg, train("pretrain", cfg, dims, resolved_yaml), flags)


def _dry_run(cfg, flags: set[str]) -> int:
    """`--dry-run [--rank N|worst]`: one rank of the full job placed on the meta device under a fake
    process group (suite.plan.dryrun); no data, no run folder, no memory check: a laptop can do it."""
    dims = validate(cfg, needs_data=False, writes_run=False)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
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


HELP = """usage: suite pretrain [recipe=NAME|PATH.yaml] [group=option ...] [key=value ...]

Causal-LM pretraining. With no arguments: gpt-tiny on the embedded corpus (built on first use),
on this machine, writing to run.dir (runs/<model.name>). Re-running the same command resumes from
the newest good checkpoint (train.resume=true). A run folder holds one run: a config that its
checkpoints do not fit (another model, tokenizer) is refused; train.overwrite=true starts clean
after moving the old run aside to <run.dir>.old-<N>.

Common keys:
  recipe={recipes}|./my.yaml
  run.dir=DIR  train.max_steps=N  train.save_every=N  train.log_every=N  train.eval_every=N
  train.seed=N  train.precision=fp32|bf16|fp16|auto  train.resume=true|false  train.overwrite=true
  train.compile=auto|true|false  parallel.micro_batch_size=N  parallel.global_batch_size=N
  parallel.dp/sharding/tp/pp=N  data.path=DIR  data.seq_len=N  model.num_layers=N  model.hidden_size=N
  model.num_heads=N  model.vocab_size=N  optim.lr=X  launch.nproc_per_node=N  log.wandb=false

Writes: <run.dir>/config.yaml, metrics.jsonl, checkpoints/step_<N>/, tokenizer.json, summary.json,
report.md + plots/*.png (suite report --help) (+ plan.json with parallel=auto; tensorboard/ with
log=tensorboard, the same scalars as metrics.jsonl, instead of wandb's offline run in wandb/)

--dry-run [--rank N|worst]: build one rank of the job as written (any world size: launch.nnodes x
launch.nproc_per_node) on the meta device under torch's fake process group, place it with the real
parallelize, and print the parameters, gradient and optimizer-state bytes that rank holds beside
the cost model's count (suite plan); nothing is allocated, no data is read. Default: the worst rank.
e.g. suite pretrain recipe=gpt175b parallel.tp=8 parallel.pp=16 parallel.sharding=8 launch.nnodes=128 --dry-run

--print-launch: print the command each of the launch.nnodes nodes runs (its launch.node_rank, the
launch.rdzv_endpoint on node 0) and run nothing; scripts/slurm/suite.sbatch runs them under srun
(also for finetune and distill). e.g. suite pretrain launch.nnodes=4 launch.rdzv_endpoint=gpu01:29500 --print-launch

parallel=auto (or parallel.auto=true): the planner (suite plan) searches the layouts of the world
this run launches (launch.nnodes x launch.nproc_per_node) on the cluster group's devices (cluster=cpu
here), keeps the recipe's global batch, and trains with the fastest that fits and that the trainer
accepts: every parallel degree, micro_batch_size and recompute. One line names it and why;
<run.dir>/plan.json holds the table, config.yaml the layout that ran. With --dry-run it plans for the
cluster group as it is (e.g. cluster=h100-80g) and builds that layout's worst rank.

Before anything is allocated, a recipe whose planned memory (its own layout, this launch) clearly
exceeds this machine's (each GPU's, or the available RAM shared by this node's CPU processes) stops
with one line: the smallest cluster of the cluster group it needs and the `suite plan` line for the
table (e.g. suite pretrain recipe=gpt175b on a laptop: exit 2, in seconds).

Examples:
  suite pretrain
  suite pretrain parallel=auto launch.nproc_per_node=2
  suite pretrain recipe=llama-tiny train.max_steps=200 run.dir=runs/llama-200
  suite pretrain recipe=moe-tiny train.precision=fp32"""


def in_rank(cfg, dims, resolved_yaml: str) -> int:
    """One rank of a pretraining run (suite.cli.worker), or the whole run in one process."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.pretrain.method import compose

    return run_method(compose, cfg, dims, resolved_yaml)


VERB = register(
    Verb(
        name="pretrain",
        summary="train a language model from scratch (default: gpt-tiny on the embedded corpus)",
        help=HELP,
        run=run,
        unused=("ckpt", "generate", "export", "prune", "finetune", "distill", "eval", "align"),
        hints={
            "ckpt": "continued pretraining starts from model.init_from: drop ckpt= and pass model.init_from={value}"
        },
        section="train",
        flags=("--dry-run", "--print-launch", OVERWRITE),
        valued_flags={"--rank": "--rank 0 (or --rank worst)"},
        composes=True,
        in_rank=in_rank,
        rank_imports=("suite.pretrain.method",),
        run_identity=RunIdentity(),
        stage_output="run",
        output_key="run.dir",
    )
)
