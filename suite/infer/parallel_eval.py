"""`suite eval metric=perplexity launch.nproc_per_node=N parallel.tp=N`: perplexity of a model too big
for one device, under tensor parallelism.

The parent checks the layout against the checkpoint's architecture (its model config replaces the
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

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite.config.errors import ConfigError

RESULT = "result.json"


def launch_perplexity(raw: Any, source: Any) -> dict[str, Any]:
    """In the parent: check, launch the workers, return rank 0's result."""
    from suite.checks import validate
    from suite.config.compose import to_object
    from suite.parallel.launcher import launch

    cfg = to_object(raw)
    e = cfg.eval
    if e.harness is not None or e.metric != "perplexity":
        raise ConfigError(
            f"launch.nproc_per_node={cfg.launch.nproc_per_node} runs metric=perplexity only; "
            "run task accuracy and harness tasks in one process (launch.nproc_per_node=1)"
        )
    if source.quantized or source.lora is not None:
        raise ConfigError(
            f"{source.named} is a {'quantized' if source.quantized else 'LoRA'} checkpoint; eval under tensor "
            "parallelism reads plain weights: export it (merge_lora=true for LoRA) and pass ckpt=hf:<folder>, "
            "or run in one process"
        )
    model = dataclasses.asdict(source.model_config())
    model.update(dropout=0.0, init_from=None)
    for key, value in model.items():
        raw.model[key] = value
    raw.train.precision = "fp32"  # as the single-process figure (load_for_inference: fp32)
    raw.data.seq_len = e.seq_len or model["max_seq_len"]  # training's window: no part of eval, kept valid
    cfg = to_object(raw)
    dims = validate(cfg, needs_data=False, writes_run=False)
    others = {
        axis: getattr(dims, axis)
        for axis in ("dp", "sharding", "pp", "cp", "ep")
        if getattr(dims, axis, 1) > 1
    }
    if others or dims.tp != dims.world_size:
        raise ConfigError(
            f"suite eval runs under tensor parallelism only; got {others or dims.world_size} — set "
            f"parallel.tp=launch.nproc_per_node (e.g. parallel.tp={dims.world_size}) and no other degree"
        )
    from suite.infer.perplexity import check_window

    check_window(e.seq_len, e.stride, cfg.model.max_seq_len)
    folder = Path(tempfile.mkdtemp(prefix="suite-eval-"))
    try:
        raw.run.dir = str(folder)  # where rank 0 writes the result
        launch("eval", OmegaConf.to_yaml(raw), cfg.launch, folder)
        result = json.loads((folder / RESULT).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def run_worker(cfg: Any, dims: Any) -> int:
    """In a launched worker: the tensor-parallel model, its shard of the weights, the windows."""
    import torch

    from suite.infer.perplexity import score_model
    from suite.models import build_model, materialize
    from suite.parallel.env import DistEnv, init_process_group
    from suite.parallel.parallelize import parallelize
    from suite.runtime import pick_device, resolve_precision
    from suite.sources import ModelSource

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
