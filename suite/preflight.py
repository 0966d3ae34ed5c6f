"""One call that checks a composed config before any process starts.

Each subsystem owns the checks of its own keys (suite.config.validate: single keys' values;
suite.models.checks, suite.data.checks, suite.parallel (degrees, pipeline, recompute, elastic
ranges), suite.runtime (precision), suite.finetune.checks, suite.compress.checks); this module only calls them, once, in
the parent. Launched workers re-check nothing, except the layout of an elastic attempt that runs
on fewer processes than the parent checked (`worker_dims`).
"""

from __future__ import annotations

from suite.compress.checks import check_no_compress, check_qat_layout
from suite.config.schema import SuiteConfig
from suite.config.validate import check_values, world_size
from suite.data.checks import check_data
from suite.models.checks import check_model
from suite.output_paths import check_run_dir
from suite.parallel.dims import ParallelDims, check_elastic, resolve_dims
from suite.parallel.recompute import check_recompute
from suite.runtime import check_device, check_precision


def validate(
    cfg: SuiteConfig,
    *,
    needs_data: bool = True,
    world: int | None = None,
    finetune: bool = False,
    distill: bool = False,
    writes_run: bool = True,
) -> ParallelDims:
    """Check everything that can be checked before any process starts; returns the resolved degrees
    (for `world` processes when given, else the job's starting world). `finetune`: also what
    finetuning cannot run (suite.finetune.checks.check_finetune ran before the base model was read).
    `writes_run`: the verb writes run.dir (pretrain, finetune), which must be a folder it can create."""
    check_values(cfg)
    check_no_compress(cfg)
    check_device(cfg.train.device)
    if writes_run and world is None:
        check_run_dir(cfg.run.dir, cfg.train.max_steps, cfg.train.resume)
    check_model(cfg.model)
    check_data(cfg, needs_data)
    check_recompute(cfg.recompute, cfg.model.num_layers)
    dims = _layout(cfg, world or world_size(cfg), finetune, distill)
    if world is None:
        check_elastic(cfg)
    return dims


def _layout(cfg: SuiteConfig, world: int, finetune: bool, distill: bool = False) -> ParallelDims:
    """The checks that depend on the world size."""
    dims = resolve_dims(cfg, world)
    check_precision(cfg, dims)
    if finetune:
        from suite.finetune.checks import check_finetune_layout

        check_finetune_layout(cfg, dims)
    if distill:
        from suite.distill.checks import check_distill_layout

        check_distill_layout(cfg, dims)
    check_qat_layout(cfg, dims, "finetune" if finetune else "distill" if distill else "pretrain")
    return dims


def worker_dims(
    cfg: SuiteConfig, world: int | None, finetune: bool = False, distill: bool = False
) -> ParallelDims:
    """A launched worker's degrees. The parent checked the job at its starting world; an elastic
    attempt on fewer processes checks its own world's layout (and nothing else again)."""
    start = world_size(cfg)
    if world is None or world == start:
        return ParallelDims.from_config(cfg.parallel, start)
    return _layout(cfg, world, finetune, distill)
