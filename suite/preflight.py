"""One call that checks a composed config before any process starts.

Each subsystem owns the checks of its own keys (suite.config.validate: single keys' values;
suite.models.checks, suite.data.checks, suite.parallel (degrees, pipeline, recompute, elastic
ranges), suite.runtime (precision), suite.compress.checks, and each verb's layout checks); this module only calls
them, once, in the parent. Launched workers re-check nothing, except the layout of an elastic attempt that runs
on fewer processes than the parent checked (`worker_dims`).
"""

from __future__ import annotations

from collections.abc import Callable

from suite.compress.checks import check_no_compress, check_qat_layout
from suite.config.schema import SuiteConfig
from suite.config.validate import check_values, world_size
from suite.data.checks import check_data
from suite.models.checks import check_model
from suite.output_paths import check_run_dir
from suite.parallel.dims import ParallelDims, check_elastic, resolve_dims
from suite.parallel.recompute import check_recompute
from suite.runtime import check_device, check_precision
from suite.train.muon import check_muon_layout

LayoutCheck = Callable[[SuiteConfig, ParallelDims], None]


def validate(
    cfg: SuiteConfig,
    *,
    needs_data: bool = True,
    world: int | None = None,
    layout_checks: tuple[LayoutCheck, ...] = (),
    writes_run: bool = True,
) -> ParallelDims:
    """Check everything that can be checked before any process starts; returns the resolved degrees
    (for `world` processes when given, else the job's starting world). `layout_checks`: what the
    verb cannot run on these degrees (suite.verb.Verb.layout_checks, e.g. finetuning's).
    `writes_run`: the verb writes run.dir (pretrain, finetune), which must be a folder it can create."""
    check_values(cfg)
    check_no_compress(cfg)
    check_device(cfg.train.device)
    if writes_run and world is None:
        check_run_dir(cfg.run.dir, cfg.train.max_steps, cfg.train.resume and not cfg.train.overwrite)
    check_model(cfg.model)
    check_data(cfg, needs_data)
    check_recompute(cfg.recompute, cfg.model.num_layers)
    dims = _layout(cfg, world or world_size(cfg), layout_checks)
    if world is None:
        check_elastic(cfg)
    return dims


def _layout(cfg: SuiteConfig, world: int, layout_checks: tuple[LayoutCheck, ...]) -> ParallelDims:
    """The checks that depend on the world size."""
    dims = resolve_dims(cfg, world)
    check_precision(cfg, dims)
    for check in layout_checks:
        check(cfg, dims)
    check_qat_layout(cfg, dims)
    check_muon_layout(cfg, dims)
    return dims


def worker_dims(
    cfg: SuiteConfig, world: int | None, layout_checks: tuple[LayoutCheck, ...] = ()
) -> ParallelDims:
    """A launched worker's degrees. The parent checked the job at its starting world; an elastic
    attempt on fewer processes checks its own world's layout (and nothing else again)."""
    start = world_size(cfg)
    if world is None or world == start:
        return ParallelDims.from_config(cfg.parallel, start)
    return _layout(cfg, world, layout_checks)
