"""`suite quantize ckpt=<run|checkpoint|hf:dir|gguf:file> compress=<method> run.dir=<out>`:
post-training quantization with torchao, measured before and after.

    1. read the model (fp32, one device) and the recipe's held-out data (the run's validation
       shards, or a finetuning run's held-out rows; for an hf:/gguf: source, this command's data.*
       in the source's own tokenizer: suite.compress.source_data)
    2. measure it: parameters, weights file bytes, held-out perplexity, greedy decode tokens/s
    3. quantize its Linear layers (suite.compress.methods; smoothquant calibrates on
       compress.calib_samples training sequences first); round the blocks' remaining float
       tensors (norms, biases) to bf16 values, stored as bf16
    4. write the run folder: checkpoints/step_<N>/ (model.safetensors with torchao's tensors,
       quantized.json, config.yaml, manifest.json), config.yaml, the tokenizer; reload it and
       check that the reloaded model's logits equal the in-memory ones
    5. measure again (on CPU with int4 in the packed kernel layout generate/eval run it in:
       suite.models.int4_cpu); report.json and a table

`suite generate` and `suite eval` read the folder as ckpt= (suite.infer.generate.load_for_inference).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from suite.compress.before_after import count_params, measure, save_plain, stored_bytes, table, write_report
from suite.compress.checks import check_compress, check_compress_model, refuse_quantized
from suite.compress.methods import linear_plan, quantize_model, usable_scales
from suite.compress.source_data import source_data
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data import ensure_prepared
from suite.data.loader import TokenBatches
from suite.data.sft import SFTBatches
from suite.finetune.data import build_sft_data
from suite.folders import claim, source_identity, write_record
from suite.folders import made_by as record
from suite.model_source import ModelSource
from suite.models import build_model
from suite.models.int4_cpu import pack_for_cpu
from suite.models.quantized import (
    WEIGHTS_FILE,
    is_quantized,
    is_quantized_tensor,
    load_quantized_model,
    narrow_block_floats,
    quantized_info,
    save_quantized,
)
from suite.runtime import check_device
from suite.train import checkpoint
from suite.train.checkpoint import list_checkpoints, staging_folder

PROMPT_TOKENS = 16


def progress(step: int, text: str) -> None:
    print(f"[{step}/5] {text}", file=sys.stderr, flush=True)


def quantize_device(cfg: SuiteConfig) -> torch.device:

    check_device(cfg.train.device)  # one line for cuda on a machine without one
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.train.device)


def output_folder(cfg: SuiteConfig, source, explicit: bool) -> Path:
    """run.dir when given, else <source run>-<method>; never a training run's folder (one that holds
    another quantization: suite.folders.claim, once every other check has passed)."""
    if explicit:
        out = Path(cfg.run.dir).expanduser()
    else:
        base = source.run_dir if source.run_dir is not None else source.folder
        out = base.parent / f"{base.name}-{cfg.compress.method}"

    if source.run_dir is not None and out.resolve() == source.run_dir.resolve():
        raise ConfigError(
            f"run.dir='{out}' is the run being quantized; pass a new folder, e.g. run.dir={out}-q"
        )
    if any(not is_quantized(c) for c in list_checkpoints(out)):
        raise ConfigError(
            f"run.dir='{out}' holds a training run's checkpoints; pass a new folder for the output"
        )
    return out


def _saved_config(cfg: SuiteConfig, source) -> SuiteConfig:
    """The config written with the output: the source run's, with this compress section and run.dir."""
    base = source.saved if source.saved is not None else SuiteConfig(model=source.model_config())
    return replace(
        base,
        compress=cfg.compress,
        run=replace(base.run, dir=str(cfg.run.dir)),
        finetune=replace(base.finetune, method="full"),  # LoRA adapters were merged into the weights
        ckpt=None,
    )


def source_recipe(source: ModelSource, tokenizer: Any, cfg: SuiteConfig) -> SuiteConfig:
    """The recipe whose data a compression measures and calibrates on: the source run's, or, for a
    model imported from outside the suite (hf:, gguf:), this command's with its data.* prepared in
    the source's own tokenizer (suite.compress.source_data) and no finetuning rows."""
    if source.saved is not None:
        return source.saved
    seq = min(cfg.data.seq_len, source.model_config().max_seq_len)
    data = source_data(replace(cfg.data, seq_len=seq), tokenizer, source.named)
    return replace(cfg, data=data, finetune=replace(cfg.finetune, data=SuiteConfig().finetune.data))


def held_out_and_calibration(saved: SuiteConfig, tokenizer: Any, cfg: SuiteConfig, tmp: Path):
    """(held-out batches, calibration batches, task) from `saved` (source_recipe). task: (name,
    held-out file, chat template) when the run was finetuned on a built-in task, else None."""
    c = cfg.compress
    calib_mb = min(8, c.calib_samples)
    calib_steps = math.ceil(c.calib_samples / calib_mb)
    mb = saved.parallel.micro_batch_size
    ft = saved.finetune.data
    if ft.task or ft.sources:  # a finetuning run: its held-out rows, its training rows
        train, held, task_file = build_sft_data(saved, tokenizer, tmp, True)
        held_mb = min(mb, len(held))
        evals = SFTBatches(held, held_mb, held_mb, split="held-out").eval_batches(c.eval_batches)
        calib_mb = min(calib_mb, len(train))
        task = (ft.task, task_file, ft.template) if ft.task and task_file and c.task_samples else None
        return evals, SFTBatches(train, calib_mb, calib_mb).eval_batches(calib_steps), task

    folder = ensure_prepared(saved.data, progress=False)
    eos = int(json.loads((folder / "meta.json").read_text())["eos_id"]) if saved.data.doc_mask else None
    seq = saved.data.seq_len
    evals = TokenBatches(folder, "val", seq, mb, mb, eos_id=eos).eval_batches(c.eval_batches)
    calib = TokenBatches(folder, "train", seq, calib_mb, calib_mb, eos_id=eos).eval_batches(calib_steps)
    return evals, calib, None


def _write_checkpoint(out: Path, step: int, model, info: dict, config_yaml: str) -> Path:
    """checkpoints/step_<N>/, committed as every checkpoint is (suite.train.checkpoint.commit:
    manifest, fsync, rename, then `latest`)."""

    tmp, final = staging_folder(out, step)
    save_quantized(model, tmp, info)
    (tmp / "config.yaml").write_text(config_yaml)
    checkpoint.commit(tmp, final, step)  # through the module: a wrapper on it sees every commit
    return final


# compress keys that make the artefact (not how it is measured: eval_batches, decode_tokens,
# task_samples; nor QAT's training keys)
ARTEFACT_KEYS = (
    "method",
    "group_size",
    "skip",
    "embedding",
    "calib_samples",
    "smoothquant_alpha",
    "gptq_damp",
    "int8_layers",
    "symmetric",
    "clip_search",
    "clip_weighted",
    "act_order",
)


def made_by(cfg: SuiteConfig, source) -> dict[str, Any]:
    """What a quantize folder records (suite.folders): the source on disk and the compress keys."""

    settings = {f"compress.{k}": getattr(cfg.compress, k) for k in ARTEFACT_KEYS}
    return record("quantize", source_identity(source.folder, source.is_hf), settings)


def _legacy(folder: Path) -> dict[str, Any] | None:
    """A quantize folder written before made_by.json: its checkpoint's quantized.json names the method."""

    found = [c for c in list_checkpoints(folder) if is_quantized(c)]
    if not found:
        return None
    return {"verb": "quantize", "settings": {"compress.method": quantized_info(found[-1]).get("method")}}


def run_quantize(cfg: SuiteConfig, explicit_dir: bool) -> dict[str, Any]:
    """The verb: returns the report (also written to <run.dir>/report.json)."""
    with tempfile.TemporaryDirectory(prefix="suite-quantize-") as tmp:
        return _quantize(cfg, explicit_dir, Path(tmp))


def _quantize(cfg: SuiteConfig, explicit_dir: bool, tmp: Path) -> dict[str, Any]:

    device = quantize_device(cfg)
    check_compress(cfg, device)
    refuse_quantized(cfg.ckpt, "ckpt", "quantizing")
    source = ModelSource.parse(cfg.ckpt, "ckpt")
    out = output_folder(cfg, source, explicit_dir)
    cfg = replace(cfg, run=replace(cfg.run, dir=str(out)))
    c = cfg.compress

    shape_only = build_model(source.model_config())  # on the meta device: names and shapes, no memory
    targets, skip = linear_plan(shape_only, c.skip)
    if not targets:
        raise ConfigError(f"compress.skip={list(c.skip)} leaves no Linear layer to quantize")
    check_compress_model(cfg, shape_only, targets, shape_only.cfg.name)
    tokenizer = source.tokenizer()
    recipe = source_recipe(
        source, tokenizer, cfg
    )  # before the model: a data.path in another tokenizer stops here
    # the last check: another quantization in run.dir is refused, or moved aside with --overwrite
    claim(out, made_by(cfg, source), "run.dir", cfg.train.overwrite, legacy=_legacy, reads=(source.folder,))

    # a LoRA run's adapters are merged into the weights by load_model: the merged weights are quantized
    progress(1, f"reading {source.named} ({source.folder}) and its held-out data")
    model = source.load_model("cpu").to(device)
    saved = _saved_config(cfg, source)
    evals, calib, task = held_out_and_calibration(recipe, tokenizer, cfg, tmp)
    prompt = evals[0].tokens[0, :PROMPT_TOKENS].tolist()
    task_eval = None
    if task is not None:
        task_eval = {"task": task[0], "file": task[1], "template": task[2], "limit": c.task_samples}
    progress(2, f"measuring the model before ({len(evals or [])} held-out batches, decode speed)")
    before = measure(model, evals, prompt, c.decode_tokens, tokenizer, task_eval)
    before["file_bytes"], before["block_bytes"] = stored_bytes(save_plain(model, tmp / "plain.safetensors"))

    # a compress=qat-* run with learned scales: its conversion rounds on them (suite.models.qat)
    trained_for = source.saved.compress.method if source.saved is not None else "none"
    learned = usable_scales(model, c, source.learned_scales(), trained_for)
    on_scales = f", {len(learned)} on the scales QAT learned" if learned else ""
    progress(
        3,
        f"quantizing {len(targets)} Linear layers with {c.method} on {device.type} ({len(skip)} skipped{on_scales})",
    )

    def calibrate(m) -> None:
        for batch in calib or []:
            batch = batch.to(device)
            m(batch.tokens, **batch.model_kwargs())

    quantize_model(model, c, device, calibrate, learned)
    narrow_block_floats(model)  # norms and biases at bf16 values, stored as bf16 (suite.models.quantized)

    progress(4, f"writing {out}")
    step = int(source.folder.name.split("_")[-1]) if not source.is_hf else 0
    info = {
        "method": c.method,
        "source": source.text,
        "torchao": _torchao_version(),
        "device": device.type,
        "quantized": targets,
        "skipped": skip,
        "learned_scales": sorted(learned),
    }
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(saved))
    write_record(out, made_by(cfg, source))
    (out / "config.yaml").write_text(config_yaml)
    tokenizer.save_pretrained(out)
    folder = _write_checkpoint(out, step, model, info, config_yaml)
    # from here on the report describes the artefact on disk, as every reader loads it
    reloaded = load_quantized_model(folder, saved.model, device)
    probe = torch.tensor([prompt], device=device)
    with torch.no_grad():
        reload_diff = float((reloaded(probe) - model(probe)).abs().max())
    del model

    model = reloaded
    weight_types = sorted({type(m.weight).__name__ for n, m in model.named_modules() if n in set(targets)})
    all_quantized = all(is_quantized_tensor(dict(model.named_modules())[t].weight) for t in targets)
    # measured as `suite generate` / `suite eval` run it: on CPU, int4 in the packed kernel's layout
    params = count_params(model)  # logical elements, counted before packing turns weights into buffers
    packed = pack_for_cpu(model) if device.type == "cpu" else []
    progress(
        5,
        f"measuring the quantized model (reloaded from disk; {len(packed)} Linear layers packed for the CPU)",
    )
    after = measure(model, evals, prompt, c.decode_tokens, tokenizer, task_eval)
    after["params"] = params
    after["file_bytes"], after["block_bytes"] = stored_bytes(folder / WEIGHTS_FILE)
    report = {
        "verb": "quantize",
        "method": c.method,
        "source": source.text,
        "out": str(out),
        "checkpoint": str(folder),
        "device": device.type,
        "torchao": info["torchao"],
        "quantized_layers": len(targets),
        "skipped_layers": skip,
        "learned_scale_layers": len(learned),
        "weight_types": weight_types,
        "all_quantized": all_quantized,
        "packed_for_cpu": len(packed),
        "held_out": f"{sum(b.num_targets for b in evals)} tokens",
        "reload_max_abs_diff": reload_diff,
        "before": before,
        "after": after,
        "table": table(before, after),
    }
    report["report"] = str(write_report(out / "report.json", report))
    return report


def _torchao_version() -> str:
    # torchao: a heavy optional dependency, imported once a model is quantized
    # deferred: torchao's version is read only for the report (seconds to import)
    import torchao

    return torchao.__version__
