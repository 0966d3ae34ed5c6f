"""`suite eval metric=perplexity launch.nproc_per_node=N parallel.tp=N`: perplexity of a model too big
for one device, under tensor parallelism.

The parent (suite.cli.verbs.eval) checks the layout against the checkpoint's architecture (its model config replaces the
recipe's, as for model.init_from) and hands the frozen config to the elastic launcher with verb
`eval`; every worker builds the model on the meta device, applies the same DTensor plan as training
(suite.parallel.parallelize), and reads only its own shard of every tensor
(ModelSource.load_weights: DCP resharding for a suite checkpoint, safetensors slices for hf:).
All ranks score the same windows (the logits are gathered over the vocabulary); rank 0 writes the
result to <launch folder>/result.json, which the parent reports. Only tensor parallelism is
offered: data or pipeline parallel degrees would split the windows or the layers, which this
verb does not do yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULT = "result.json"


def run_worker(cfg: Any, dims: Any) -> int:
    """In a launched worker: the tensor-parallel model, its shard of the weights, the windows."""
    # deferred: suite --help imports this module (suite.cli.verbs.eval reads RESULT); the worker's engine
    # (parallelize, DCP, the model sources: ~100 modules, seconds) stays out of it
    import torch

    from suite.infer.perplexity import score_model
    from suite.model_source import ModelSource
    from suite.models import build_model, materialize
    from suite.parallel.env import DistEnv, init_process_group
    from suite.parallel.parallelize import parallelize
    from suite.runtime import pick_device, resolve_precision

    env = DistEnv.from_environ()
    device = pick_device(cfg.train.device, env)
    precision = resolve_precision(cfg.train, device)
    init_process_group(env, device, cfg.launch.backend, cfg.train.collective_timeout_s)
    source = ModelSource.parse(cfg.ckpt, "ckpt")
    torch.manual_seed(cfg.train.seed)
    placement = parallelize(build_model(cfg.model, "meta"), cfg, dims, device, precision)
    model = placement.model
    if placement.materialized is False:
        materialize(model, device, cfg.train.seed)
    source.load_weights(model, cfg.model.fused_projections)
    model.eval()
    result = score_model(model, source.tokenizer(), source, cfg, source.folder, progress=False)
    if env.is_main:
        result["tp"] = dims.tp
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        result["rank0_param_fraction"] = local / sum(p.numel() for p in model.parameters())
        (Path(cfg.run.dir) / RESULT).write_text(json.dumps(result))
    return 0
