"""`parallel=auto`: the planner picks the layout a training run launches with.

In the parent process, before any worker starts: the search of `suite plan` runs for the world this
run launches (launch.nnodes x launch.nproc_per_node) on the devices of the cluster group (sized to
the launch: suite.plan.fit.launched_cluster), the recipe's global batch kept. Its ranked layouts are
tried fastest first against the trainer's own checks (suite.preflight.validate: what the planner does
not model, e.g. the data or precision rules); the first one accepted is written into the config
(every parallel degree, micro_batch_size, recompute), so the run folder's config.yaml records the
layout that ran and replays it without the planner (`parallel.auto: false` there).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import DictConfig

from suite.config.compose import to_object
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.config.validate import nproc_range
from suite.plan.command import job_of, no_fit
from suite.plan.cost import GIB, Cost
from suite.plan.fit import launched_cluster, run_device
from suite.plan.layout import Job
from suite.plan.search import SearchResult, search
from suite.plan.tables import TIME_PARTS, as_json
from suite.preflight import validate

PARALLEL_KEYS = (
    "dp", "sharding", "sharding_stage", "offload", "tp", "sp", "pp", "pp_schedule", "vpp", "cp", "ep",
    "micro_batch_size",
)  # fmt: skip
MAX_TRIES = 64  # ranked layouts tried against the trainer's checks before giving up


@dataclass
class Choice:
    """The layout `parallel=auto` settled on, the config that runs it, and the search behind it."""

    raw: DictConfig  # the composed config with the layout written in
    cfg: SuiteConfig
    cost: Cost
    job: Job
    result: SearchResult
    refused: list[tuple[str, str]]  # faster layouts the trainer refused: (name, its one-line reason)

    def line(self, table: str) -> str:
        """One line: the layout, why it won, where the table is."""
        best, c = self.cost, self.job.cluster
        parts = [
            f"parallel=auto: {best.layout.name} on {c.nodes} x {c.devices_per_node} {c.name}, the fastest of "
            f"{len(self.result.ranked)} layouts that fit ({best.time.total:.4g} s/step, "
            f"{best.memory.total / GIB:.2f} GiB per process predicted"
        ]
        rival = runner_up(self.result, best)
        if rival is not None:
            slower = rival.time.total / best.time.total - 1
            margin = (
                f"{slower:+.1%}{_gain(best, rival)}" if slower >= 0.001 else "as fast, the winner is simpler"
            )
            parts.append(f"; next shape {rival.layout.name}: {margin}")
        if self.refused:
            name, why = self.refused[0]
            parts.append(f"; {len(self.refused)} faster refused by the trainer, e.g. {name}: {why}")
        return "".join(parts) + f"); plan table: {table}"

    def as_json(self) -> dict:
        """plan.json: the search (as `suite plan --json`), the chosen layout and what was refused."""
        return {
            **as_json(self.job, self.result),
            "chosen": self.cost.as_dict(),
            "chosen_overrides": self.cost.layout.overrides(self.job.global_batch),
            "refused": [{"layout": n, "reason": r} for n, r in self.refused],
        }

    def write(self, run_dir: str | Path) -> Path:
        """plan.json in the run folder, beside config.yaml."""
        path = Path(run_dir).expanduser() / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(), indent=1) + "\n")
        return path


def runner_up(result: SearchResult, best: Cost) -> Cost | None:
    """The fastest layout of another shape (other degrees) than `best`."""
    shape = _shape(best)
    return next((c for c in result.ranked if _shape(c) != shape), None)


def _shape(cost: Cost) -> tuple:
    layout = cost.layout
    return (layout.dp, layout.sharding, layout.stage, layout.tp, layout.pp, layout.cp, layout.ep)


def _gain(best: Cost, rival: Cost) -> str:
    delta, label = max((getattr(rival.time, k) - getattr(best.time, k), v) for k, v in TIME_PARTS.items())
    return f" (more {label})" if delta > 0 else ""


def with_layout(raw: DictConfig, cost: Cost, global_batch: int) -> DictConfig:
    """A copy of the composed config that runs `cost.layout`: every parallel key and the recompute
    group set, `parallel.auto` off (the record replays without the planner)."""
    out = copy.deepcopy(raw)  # keeps the structured schema (types, `to_object`)
    pc = cost.layout.parallel_config(global_batch)
    for key in PARALLEL_KEYS:
        out.parallel[key] = getattr(pc, key)
    out.parallel.auto = False
    out.recompute.granularity = cost.layout.recompute
    out.recompute.num_layers = None
    out.recompute.skip_layers = 0
    return out


def check_auto(cfg: SuiteConfig, here: bool = True) -> None:
    """What `parallel=auto` cannot plan: an elastic world, or (for a run `here`, not a dry run) a
    cluster group of other devices than the ones this run trains on."""
    low, high = nproc_range(cfg)
    if low != high:
        raise ConfigError(
            f"parallel=auto with the elastic launch.nproc_per_node={cfg.launch.nproc_per_node}: the planner "
            f"picks degrees for one world size; pass launch.nproc_per_node={high} (or parallel=fsdp for elastic runs)"
        )
    device = run_device(cfg)
    if here and cfg.cluster.device_type != device:
        hint = (
            "cluster=cpu" if device == "cpu" else "the cluster preset of these GPUs (e.g. cluster=h100-80g)"
        )
        raise ConfigError(
            f"parallel=auto plans for the devices this run trains on ({device}), but cluster={cfg.cluster.name} "
            f"describes {cfg.cluster.device_type} devices; pass {hint}"
        )


def choose_layout(raw: DictConfig, validate_fn=None, here: bool = True) -> Choice:
    """Search the launch's world and return the fastest layout the trainer accepts (module
    docstring). `validate_fn(cfg)` raises ConfigError for a config the trainer refuses (default:
    suite.preflight.validate without the run-folder and data checks, which do not depend on the layout).
    `here=False` (a dry run, nothing allocated): the cluster group as it is, whatever this machine has."""
    cfg = to_object(raw)
    check_auto(cfg, here)
    job = replace(job_of(cfg), cluster=launched_cluster(cfg, here))
    result = search(job)
    if not result.ranked:
        raise ConfigError(f"parallel=auto: {no_fit(job, result)}")
    if validate_fn is None:

        def validate_fn(c: SuiteConfig) -> object:
            return validate(c, needs_data=False, writes_run=False)

    refused: list[tuple[str, str]] = []
    for cost in result.ranked[:MAX_TRIES]:
        candidate = with_layout(raw, cost, job.global_batch)
        cfg = to_object(candidate)
        try:
            validate_fn(cfg)
        except ConfigError as exc:
            refused.append((cost.layout.name, str(exc)))
            continue
        return Choice(candidate, cfg, cost, job, result, refused)
    name, why = refused[0]
    raise ConfigError(
        f"parallel=auto: the trainer refuses the {len(refused)} fastest of {len(result.ranked)} layouts that "
        f"fit; the fastest, {name}: {why}"
    )
