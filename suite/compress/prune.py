"""`suite prune`: structured pruning of a dense model into a smaller dense model of the same family.

Importance comes from activations on calibration data (compress.calib_samples sequences of the
source run's data), as in Minitron (Muralidharan et al., 2024): suite.compress.importance scores MLP
channels, attention heads, hidden (embedding) channels and whole layers.

`prune.ffn` (a fraction) keeps the most important channels of every MLP, the same count in each layer
(the config holds one ffn_hidden_size). `prune.heads` (a fraction) keeps the most important query heads
of every layer, the same count in each (one num_heads); with grouped KV heads every KV group keeps the
same number of its own query heads and all KV heads stay (the kept count a multiple of num_kv_heads),
or, for a fraction that is whole groups, the least important groups go with their KV head (query
head scores combined by L2); without grouped KV heads a head's query, key and value go together. The heads keep their size
(model.head_dim is written when hidden_size / num_heads no longer gives it). `prune.hidden` (a
fraction) keeps the most important embedding channels everywhere: token (and GPT position) embeddings,
every norm, the q/k/v, MLP-in and output-head input columns, the attention-out and MLP-out rows.
`prune.layers` (a count) drops the least important blocks. The kept weights are sliced out of the
source's own, the remaining blocks renumbered in order; the result is a plain suite run folder
(config.yaml, a DCP checkpoint, the tokenizer) that every verb reads, and that
`suite distill distill.teacher=<source> model.init_from=<pruned>` or `suite finetune` heal. Pruning
ffn channels, heads and layers is exact (the source with those zeroed or skipped); pruning hidden
channels is not (the norms then normalise over the kept channels only). A GPT model with pruned heads
(head_dim != hidden_size / num_heads) does not export to Hugging Face: GPT-2's config cannot hold it
(suite.export.checks.check_hf_exportable).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from suite.compress.before_after import measure, save_plain, stored_bytes, table, write_report
from suite.compress.checks import refuse_quantized
from suite.compress.importance import Importance, importance
from suite.compress.quantize import held_out_and_calibration, progress, source_recipe
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.folders import claim, source_identity, write_record
from suite.folders import made_by as record
from suite.model_source import ModelSource
from suite.models import build_model, materialize
from suite.models.transformer import ffn_size, fuse_state_dict, head_size, kv_heads, unfuse_state_dict
from suite.train.checkpoint import save_checkpoint

__all__ = ["check_prune", "importance", "plan", "pruned_state", "run_prune"]


def _fraction(value: float) -> str:
    return f"{value:.4g}"


def _fraction_key(key: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"prune.{key}={value} must be a fraction in [0, 1) of what to remove, e.g. 0.25")


def _heads_kept(cfg: SuiteConfig, model_cfg) -> tuple[int, int]:
    """(query heads, KV heads) kept per layer; one line naming the nearest prune.heads that work
    otherwise. With grouped KV heads either every group keeps the same number of its query heads (all
    KV heads stay), or whole groups go (a KV head with all its query heads)."""

    f, heads, groups = cfg.prune.heads, model_cfg.num_heads, kv_heads(model_cfg)
    keep = int(round(heads * (1 - f)))
    if not f:
        return heads, groups
    grouped = groups < heads
    per = heads // groups
    within = {k: groups for k in range(groups, heads, groups)} if grouped else {k: k for k in range(1, heads)}
    whole = {k: k // per for k in range(per, heads, per)} if grouped else {}
    works = {**whole, **within}  # where both work, every KV head stays
    if keep in works:
        return keep, works[keep]
    if keep <= 0:
        why = "none would be left"
    elif keep >= heads:
        why = "that removes none"
    else:
        why = (
            f"each of the {groups} KV groups must keep the same number of its query heads, or whole "
            f"groups of {per} go"
        )
    if not works:
        raise ConfigError(
            f"prune.heads={f} keeps {keep} of {heads} heads per layer: {why}, and the model has one head "
            "per layer, so no fraction works; leave prune.heads=0"
        )
    below = [k for k in works if k < keep] or [min(works)]
    above = [k for k in works if k > keep] or [max(works)]
    near = sorted({max(below), min(above)}, reverse=True)
    options = " or ".join(f"prune.heads={_fraction(1 - k / heads)} (keeps {k})" for k in near)
    raise ConfigError(f"prune.heads={f} keeps {keep} of {heads} heads per layer, but {why}; use {options}")


def check_prune(cfg: SuiteConfig, model_cfg) -> dict[str, int]:
    """One line for a plan that leaves nothing or removes nothing; returns the sizes kept:
    {width (MLP), heads (per layer), hidden}."""

    p = cfg.prune
    for key in ("ffn", "heads", "hidden"):
        _fraction_key(key, getattr(p, key))
    if not (p.ffn or p.layers or p.heads or p.hidden):
        raise ConfigError(
            "prune: nothing to prune; set prune.ffn=<fraction>, prune.heads=<fraction>, "
            "prune.hidden=<fraction> and/or prune.layers=<count>"
        )
    if model_cfg.num_experts:
        raise ConfigError(f"model.num_experts={model_cfg.num_experts}: prune a dense model")
    width = ffn_size(model_cfg)
    keep_width = int(round(width * (1 - p.ffn)))
    if p.ffn and not 0 < keep_width < width:
        raise ConfigError(
            f"prune.ffn={p.ffn} keeps {keep_width} of {width} MLP channels; use a fraction in (0, 1)"
        )
    hidden = model_cfg.hidden_size
    keep_hidden = int(round(hidden * (1 - p.hidden)))
    if p.hidden and not 0 < keep_hidden < hidden:
        raise ConfigError(
            f"prune.hidden={p.hidden} keeps {keep_hidden} of {hidden} hidden channels; use a fraction "
            f"that keeps between 1 and {hidden - 1} (e.g. prune.hidden=0.25)"
        )
    if not 0 <= p.layers < model_cfg.num_layers:
        raise ConfigError(
            f"prune.layers={p.layers}: the model has {model_cfg.num_layers} layers; remove between 0 and "
            f"{model_cfg.num_layers - 1}"
        )
    heads, kv = _heads_kept(cfg, model_cfg)
    return {"width": keep_width, "heads": heads, "kv_heads": kv, "hidden": keep_hidden}


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores, in their original order."""
    return torch.sort(torch.topk(scores, k).indices).values


def kept_heads(scores: torch.Tensor, keep: int, groups: int, kv_keep: int | None = None) -> torch.Tensor:
    """Query heads kept in one layer (sorted): the `keep` most important overall; with grouped KV heads
    (groups < heads) the keep / groups most important of each group's own query heads, or, when
    kv_keep < groups, every query head of the kv_keep groups whose heads matter most together."""
    heads = scores.numel()
    if groups >= heads:
        return _top(scores, keep)
    per = heads // groups
    if kv_keep is not None and kv_keep < groups:
        group_scores = scores.view(groups, per).pow(2).sum(dim=1)  # head scores are L2 norms
        return _rows(_top(group_scores, kv_keep), per)
    return torch.cat([_top(scores[g * per : (g + 1) * per], keep // groups) + g * per for g in range(groups)])


def plan(cfg: SuiteConfig, model_cfg, scores: Importance) -> dict[str, Any]:
    """What to keep: layers (sorted), and per kept layer its MLP channels and query heads (None: all),
    and the hidden channels (None: all)."""

    p = cfg.prune
    sizes = check_prune(cfg, model_cfg)
    order = torch.argsort(scores.layers, descending=True)  # most change first
    kept_layers = sorted(order[: model_cfg.num_layers - p.layers].tolist())
    channels = {i: _top(scores.channels[i], sizes["width"]) for i in kept_layers}
    heads = None
    if p.heads:
        groups = kv_heads(model_cfg)
        heads = {
            i: kept_heads(scores.heads[i], sizes["heads"], groups, sizes["kv_heads"]) for i in kept_layers
        }
    hidden = _top(scores.hidden, sizes["hidden"]) if p.hidden else None
    return {**sizes, "layers": kept_layers, "channels": channels, "kept_heads": heads, "hidden_kept": hidden}


def pruned_config(model_cfg, chosen: dict[str, Any]):
    """The pruned model's config: the kept sizes; the heads keep their size (head_dim written when
    hidden_size / num_heads no longer gives it)."""

    new = dataclasses.replace(
        model_cfg, num_layers=len(chosen["layers"]), ffn_hidden_size=chosen["width"], init_from=None
    )
    if chosen["kept_heads"] is None and chosen["hidden_kept"] is None:
        return new
    size, heads, hidden = head_size(model_cfg), chosen["heads"], chosen["hidden"]
    grouped = kv_heads(model_cfg) < model_cfg.num_heads
    num_kv = chosen["kv_heads"] if grouped else (None if model_cfg.num_kv_heads is None else heads)
    return dataclasses.replace(
        new,
        num_heads=heads,
        num_kv_heads=num_kv,
        hidden_size=hidden,
        head_dim=None if hidden == heads * size else size,
    )


def _rows(heads: torch.Tensor, size: int) -> torch.Tensor:
    """Head indices -> the rows (or columns) of their channels in a [heads * size] projection."""
    return (heads[:, None] * size + torch.arange(size)).flatten()


def pruned_state(
    model_cfg, state: dict[str, torch.Tensor], chosen: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The unfused state dict of the pruned model (`model_cfg`: the source's): kept layers renumbered,
    MLP channels, query heads (with their keys and values when KV heads are not grouped) and hidden
    channels sliced out of every tensor that holds them."""

    hidden = chosen["hidden_kept"]
    size, grouped = head_size(model_cfg), kv_heads(model_cfg) < model_cfg.num_heads

    def take(value: torch.Tensor, dim: int, index: torch.Tensor | None) -> torch.Tensor:
        return value if index is None else value.index_select(dim, index)

    def kv_rows(layer: str) -> torch.Tensor | None:
        """Grouped KV heads: the rows of the kept groups' keys or values (None: every group stays)."""
        if chosen["kept_heads"] is None or chosen["kv_heads"] == kv_heads(model_cfg):
            return None
        per = model_cfg.num_heads // kv_heads(model_cfg)
        groups = chosen["kept_heads"][int(layer)][::per] // per
        return _rows(groups, size)

    out = {}
    renumber = {old: new for new, old in enumerate(chosen["layers"])}
    for name, value in state.items():
        if not name.startswith("layers."):  # embeddings, the final norm, the output head: hidden channels
            out[name] = take(value, value.dim() - 1, hidden).contiguous()
            continue
        _, index, rest = name.split(".", 2)
        if int(index) not in renumber:
            continue
        keep = chosen["channels"][int(index)]
        heads = None if chosen["kept_heads"] is None else _rows(chosen["kept_heads"][int(index)], size)
        out_index = in_index = None  # [out, in] of a weight; a bias is [out]
        module = rest.rsplit(".", 1)[0]
        if module.endswith("_norm"):
            out_index = hidden
        elif module == "attention.wq":
            out_index, in_index = heads, hidden
        elif module in ("attention.wk", "attention.wv"):
            out_index, in_index = (kv_rows(index) if grouped else heads), hidden
        elif module == "attention.wo":
            out_index, in_index = hidden, heads
        elif module in ("feed_forward.w1", "feed_forward.w3"):
            out_index, in_index = keep, hidden
        elif module == "feed_forward.w2":
            out_index, in_index = hidden, keep
        value = take(value, 0, out_index)
        if value.dim() == 2:
            value = take(value, 1, in_index)
        out[f"layers.{renumber[int(index)]}.{rest}"] = value.contiguous()
    return out


def made_by(cfg: SuiteConfig, source) -> dict[str, Any]:
    """What a prune folder records (suite.folders): the source on disk, the plan, its calibration."""

    settings = {f"prune.{f.name}": getattr(cfg.prune, f.name) for f in dataclasses.fields(cfg.prune)}
    settings["compress.calib_samples"] = cfg.compress.calib_samples
    return record("prune", source_identity(source.folder, source.is_hf), settings)


def run_prune(cfg: SuiteConfig, explicit_dir: bool) -> dict[str, Any]:
    """The verb: returns the report (also written to <run.dir>/report.json)."""
    with tempfile.TemporaryDirectory(prefix="suite-prune-") as tmp:
        return _prune(cfg, explicit_dir, Path(tmp))


def _prune(cfg: SuiteConfig, explicit_dir: bool, tmp: Path) -> dict[str, Any]:

    p = cfg.prune
    refuse_quantized(cfg.ckpt, "ckpt", "pruning")
    source = ModelSource.parse(cfg.ckpt, "ckpt")
    base = source.run_dir if source.run_dir is not None else source.folder
    out = Path(cfg.run.dir).expanduser() if explicit_dir else base.parent / f"{base.name}-pruned"
    if out.resolve() == base.resolve():
        raise ConfigError(f"run.dir='{out}' is the source run; pass a new folder, e.g. run.dir={out}-pruned")
    model_cfg = source.model_config()
    check_prune(cfg, model_cfg)
    tokenizer = source.tokenizer()
    recipe = source_recipe(source, tokenizer, cfg)  # an hf:/gguf: source: this command's, in its tokenizer
    made = made_by(cfg, source)  # another model's or plan's output: refused or moved aside
    claim(out, made, "run.dir", cfg.train.overwrite, reads=(source.folder,))

    progress(1, f"reading {source.named} ({source.folder}) and calibration data")
    model = source.load_model("cpu")
    evals, calib, task = held_out_and_calibration(recipe, tokenizer, cfg, tmp)
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
    scores = importance(model, calib)
    chosen = plan(cfg, model_cfg, scores)
    new_cfg = pruned_config(model_cfg, chosen)
    state = pruned_state(model_cfg, unfuse_state_dict(model_cfg, model.state_dict()), chosen)
    pruned = materialize(build_model(new_cfg), "cpu", seed=0)
    if new_cfg.fused_projections:
        state = fuse_state_dict(new_cfg, state)
    pruned.load_state_dict(state, strict=True)
    pruned.eval()

    progress(4, f"writing {out}")
    saved = dataclasses.replace(
        recipe,
        model=new_cfg,
        prune=p,
        run=dataclasses.replace(recipe.run, dir=str(out)),
        finetune=dataclasses.replace(recipe.finetune, method="full"),
        ckpt=None,
    )
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(saved))
    write_record(out, made)
    (out / "config.yaml").write_text(config_yaml)
    tokenizer.save_pretrained(out)
    folder = save_checkpoint(out, 0, pruned, None, {"step": 0}, config_yaml)

    progress(5, "measuring the pruned model (reloaded from disk)")
    pruned = ModelSource.parse(str(out), "run.dir").load_model("cpu")  # the artefact, as readers load it
    after = measure(pruned, evals, prompt, cfg.compress.decode_tokens, tokenizer, task_eval)
    after["file_bytes"], after["block_bytes"] = stored_bytes(save_plain(pruned, tmp / "after.safetensors"))
    report = {
        "verb": "prune",
        "source": source.text,
        "out": str(out),
        "checkpoint": str(folder),
        "ffn_hidden_size": [model.layers["0"].feed_forward.w2.in_features, chosen["width"]],
        "num_heads": [model_cfg.num_heads, new_cfg.num_heads],
        "hidden_size": [model_cfg.hidden_size, new_cfg.hidden_size],
        "head_dim": head_size(new_cfg),
        "layers_kept": chosen["layers"],
        "layer_importance": [round(float(x), 6) for x in scores.layers],
        # per kept layer (new order): the source's query heads it kept; None: all
        "heads_kept": None
        if chosen["kept_heads"] is None
        else [chosen["kept_heads"][i].tolist() for i in chosen["layers"]],
        "head_importance": [[round(float(x), 6) for x in layer] for layer in scores.heads],
        "before": before,
        "after": after,
        "num_kv_heads": [kv_heads(model_cfg), kv_heads(new_cfg)],
        "table": table(
            before,
            after,
            {
                "layers": (model_cfg.num_layers, new_cfg.num_layers),
                "attention heads": (model_cfg.num_heads, new_cfg.num_heads),
                "KV heads": (kv_heads(model_cfg), kv_heads(new_cfg)),
                "hidden size": (model_cfg.hidden_size, new_cfg.hidden_size),
                "MLP width": (model.layers["0"].feed_forward.w2.in_features, chosen["width"]),
            },
        ),
    }
    report["report"] = str(write_report(out / "report.json", report))
    return report
