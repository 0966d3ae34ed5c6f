"""`suite plan`: from a composed recipe (with its cluster group) to the printed or JSON result."""

from __future__ import annotations

from dataclasses import replace

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.config.validate import check_values
from suite.plan.cost import evaluate
from suite.plan.layout import Job, check_layout, parse_layout
from suite.plan.search import search, smallest_cluster
from suite.plan.tables import as_json, explain, leanest, table


def job_of(cfg: SuiteConfig) -> Job:
    """The job of a recipe, its keys checked one by one (one-line ConfigErrors)."""
    check_values(cfg)
    job = Job.from_config(cfg)
    if job.precision not in cfg.cluster.peak_flops:
        known = ", ".join(cfg.cluster.peak_flops)
        raise ConfigError(
            f"train.precision={job.precision}: cluster {cfg.cluster.name} has no peak_flops.{job.precision} "
            f"(it has {known}); set train.precision to one of them or cluster.peak_flops.{job.precision}=<FLOP/s>"
        )
    return job


def run_plan(cfg: SuiteConfig, layout_name: str | None = None) -> tuple[dict, str]:
    """(JSON result, text) of the search, or of one layout's breakdown when `layout_name` is given."""
    job = job_of(cfg)
    if layout_name:
        layout = parse_layout(layout_name)
        try:
            check_layout(job, layout)
        except ConfigError as exc:
            raise ConfigError(f"--explain {layout_name}: {exc}") from None
        cost = evaluate(job, layout)
        return cost.as_dict(), explain(job, cost)
    result = search(job)
    if not result.ranked:
        raise ConfigError(no_fit(job, result))
    return as_json(job, result), table(job, result)


def no_fit(job: Job, result) -> str:
    """One line: nothing fits here; the leanest layout's need, and the nodes the planner would need."""
    c = job.cluster
    host = f", {c.host_memory_gib:g} GiB host memory per node" if c.host_memory_gib is not None else ""
    where = f"{c.nodes} x {c.devices_per_node} {c.name} ({c.memory_gib - c.reserved_gib:.1f} GiB usable per device{host})"
    lean = leanest(job, result)
    nodes = smallest_cluster(replace(job, cluster=replace(c, nodes=1)))
    need = (
        f"the smallest {c.name} cluster it fits is cluster.nodes={nodes} ({nodes * c.devices_per_node} devices)"
        if nodes
        else "no cluster of up to 4096 such nodes holds it"
    )
    return f"no layout of {job.model.name} fits {where}{lean}; {need}"
