"""`suite prune`: structured pruning of a dense model into a smaller dense model of the same family.

Importance comes from activations on calibration data (compress.calib_samples sequences of the
source run's data), as in Minitron (Muralidharan et al., 2024):

    MLP channels   at the input of each block's down projection (w2): the magnitude |x| averaged over
                   the sequence, then the L2 norm over the calibration samples
    layers         1 - cosine similarity between a block's input and output, averaged over tokens: a
                   block that barely changes its input matters least

`prune.ffn` (a fraction) keeps the most important channels of every MLP, the same count in each layer
(the config holds one ffn_hidden_size); `prune.layers` (a count) drops the least important blocks. The
pruned weights are sliced out of the source's own (gate/up rows and biases, down-projection columns),
the remaining blocks renumbered in order; the result is a plain suite run folder (config.yaml, a DCP
checkpoint, the tokenizer) that every verb reads, that exports to Hugging Face, and that
`suite distill distill.teacher=<source> model.init_from=<pruned>` or `suite finetune` heal. Attention
heads and hidden channels (prune.heads, prune.hidden) need a head size independent of the width in the
model config, which the suite does not have yet: refused.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig


@torch.no_grad()
def importance(model: nn.Module, batches: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([per layer: MLP channel importance [ffn]], layer importance [num_layers]) on `batches`."""
    blocks = list(model.layers.values())
    channel_sq = [None] * len(blocks)
    change = torch.zeros(len(blocks), dtype=torch.float64)
    tokens = 0
    hooks = []

    def on_down_input(i):
        def hook(module, args):
            x = args[0].float()  # [b, s, ffn]
            per_sample = x.abs().mean(dim=1)  # mean over the sequence
            sq = (per_sample**2).sum(dim=0)  # L2 over the batch, squared (summed over batches)
            channel_sq[i] = sq if channel_sq[i] is None else channel_sq[i] + sq

        return hook

    def on_block(i):
        def hook(module, args, output):
            x, y = args[0].float().flatten(0, 1), output.float().flatten(0, 1)
            change[i] += (1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)).double().sum()

        return hook

    for i, block in enumerate(blocks):
        ff = block.feed_forward
        if not hasattr(ff, "w2"):
            raise ConfigError("prune: the source has Mixture-of-Experts layers; pruning needs a dense model")
        hooks.append(ff.w2.register_forward_pre_hook(on_down_input(i)))
        hooks.append(block.register_forward_hook(on_block(i)))
    try:
        for batch in batches:
            model(batch.tokens, **batch.model_kwargs())
            tokens += batch.tokens.numel()
    finally:
        for h in hooks:
            h.remove()
    return [c.sqrt() for c in channel_sq], (change / max(tokens, 1)).float()


def check_prune(cfg: SuiteConfig, model_cfg) -> int:
    """One line for a plan that leaves nothing or removes nothing; returns the MLP width kept."""
    from suite.models.transformer import ffn_size

    p = cfg.prune
    if p.heads or p.hidden:
        raise ConfigError(
            f"prune.heads={p.heads} / prune.hidden={p.hidden}: pruning attention heads or hidden channels needs a "
            "head size independent of the width, which the model config does not have yet; use prune.ffn and "
            "prune.layers"
        )
    if not p.ffn and not p.layers:
        raise ConfigError("prune: nothing to prune; set prune.ffn=<fraction> and/or prune.layers=<count>")
    width = ffn_size(model_cfg)
    keep_width = int(round(width * (1 - p.ffn)))
    if p.ffn and not 0 < keep_width < width:
        raise ConfigError(
            f"prune.ffn={p.ffn} keeps {keep_width} of {width} MLP channels; use a fraction in (0, 1)"
        )
    if not 0 <= p.layers < model_cfg.num_layers:
        raise ConfigError(
            f"prune.layers={p.layers}: the model has {model_cfg.num_layers} layers; remove between 0 and "
            f"{model_cfg.num_layers - 1}"
        )
    if model_cfg.num_experts:
        raise ConfigError(f"model.num_experts={model_cfg.num_experts}: prune a dense model")
    return keep_width


def plan(cfg: SuiteConfig, model_cfg, channels: list[torch.Tensor], layers: torch.Tensor) -> dict[str, Any]:
    """Which MLP channels (per kept layer, sorted) and which layers to keep."""
    p = cfg.prune
    keep_width = check_prune(cfg, model_cfg)
    order = torch.argsort(layers, descending=True)  # most change first
    kept_layers = sorted(order[: model_cfg.num_layers - p.layers].tolist())
    kept_channels = {i: torch.sort(torch.topk(channels[i], keep_width).indices).values for i in kept_layers}
    return {"width": keep_width, "layers": kept_layers, "channels": kept_channels}


def pruned_state(
    model_cfg, state: dict[str, torch.Tensor], chosen: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The unfused state dict of the pruned model: kept layers renumbered, MLP channels sliced."""
    out = {}
    renumber = {old: new for new, old in enumerate(chosen["layers"])}
    for name, value in state.items():
        if not name.startswith("layers."):
            out[name] = value
            continue
        _, index, rest = name.split(".", 2)
        if int(index) not in renumber:
            continue
        keep = chosen["channels"][int(index)]
        if rest.startswith(("feed_forward.w1.", "feed_forward.w3.")):
            value = value[keep]
        elif rest == "feed_forward.w2.weight":
            value = value[:, keep]
        out[f"layers.{renumber[int(index)]}.{rest}"] = value.contiguous()
    return out


def run_prune(cfg: SuiteConfig, explicit_dir: bool) -> dict[str, Any]:
    """The verb: returns the report (also written to <run.dir>/report.json)."""
    with tempfile.TemporaryDirectory(prefix="suite-prune-") as tmp:
        return _prune(cfg, explicit_dir, Path(tmp))


def _prune(cfg: SuiteConfig, explicit_dir: bool, tmp: Path) -> dict[str, Any]:
    from suite.compress.checks import refuse_quantized
    from suite.compress.quantize import held_out_and_calibration, progress
    from suite.compress.report import measure, save_plain, stored_bytes, table, write_report
    from suite.models import build_model, materialize
    from suite.models.transformer import fuse_state_dict, unfuse_state_dict
    from suite.sources import ModelSource
    from suite.train.checkpoint import save_checkpoint

    p = cfg.prune
    refuse_quantized(cfg.ckpt, "ckpt", "pruning")
    source = ModelSource.parse(cfg.ckpt, "ckpt")
    if source.saved is None:
        raise ConfigError(
            f"{source.named} is an HF folder: pruning calibrates on a suite run's data; prune a suite run"
        )
    base = source.run_dir
    out = Path(cfg.run.dir).expanduser() if explicit_dir else base.parent / f"{base.name}-pruned"
    if out.resolve() == base.resolve() or (out / "checkpoints").exists():
        raise ConfigError(f"run.dir='{out}' is the source run or holds checkpoints; pass a new folder")
    model_cfg = source.model_config()
    check_prune(cfg, model_cfg)

    progress(1, f"reading {source.named} ({source.folder}) and calibration data")
    model = source.load_model("cpu")
    tokenizer = source.tokenizer()
    evals, calib, task = held_out_and_calibration(source.saved, tokenizer, cfg, tmp)
    prompt = evals[0].tokens[0, :16].tolist()
    task_eval = None
    if task is not None:
        task_eval = {
            "task": task[0],
            "file": task[1],
            "template": task[2],
            "limit": cfg.compress.task_samples,
        }
    progress(2, "measuring the model before")
    before = measure(model, evals, prompt, cfg.compress.decode_tokens, tokenizer, task_eval)
    before["file_bytes"], before["block_bytes"] = stored_bytes(save_plain(model, tmp / "before.safetensors"))

    progress(3, f"importance on {sum(b.tokens.shape[0] for b in calib)} calibration sequences")
    channels, layers = importance(model, calib)
    chosen = plan(cfg, model_cfg, channels, layers)
    new_cfg = dataclasses.replace(
        model_cfg, num_layers=len(chosen["layers"]), ffn_hidden_size=chosen["width"], init_from=None
    )
    state = pruned_state(new_cfg, unfuse_state_dict(model_cfg, model.state_dict()), chosen)
    pruned = materialize(build_model(new_cfg), "cpu", seed=0)
    if new_cfg.fused_projections:
        state = fuse_state_dict(new_cfg, state)
    pruned.load_state_dict(state, strict=True)
    pruned.eval()

    progress(4, f"writing {out}")
    saved = dataclasses.replace(
        source.saved,
        model=new_cfg,
        prune=p,
        run=dataclasses.replace(source.saved.run, dir=str(out)),
        finetune=dataclasses.replace(source.saved.finetune, method="full"),
        ckpt=None,
    )
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(saved))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(config_yaml)
    tokenizer.save_pretrained(out)
    folder = save_checkpoint(out, 0, pruned, None, {"step": 0}, config_yaml)

    progress(5, "measuring the pruned model")
    after = measure(pruned, evals, prompt, cfg.compress.decode_tokens, tokenizer, task_eval)
    after["file_bytes"], after["block_bytes"] = stored_bytes(save_plain(pruned, tmp / "after.safetensors"))
    report = {
        "verb": "prune",
        "source": source.text,
        "out": str(out),
        "checkpoint": str(folder),
        "ffn_hidden_size": [model.layers["0"].feed_forward.w2.in_features, chosen["width"]],
        "layers_kept": chosen["layers"],
        "layer_importance": [round(float(x), 6) for x in layers],
        "before": before,
        "after": after,
        "table": table(before, after),
    }
    report["report"] = str(write_report(out / "report.json", report))
    return report
