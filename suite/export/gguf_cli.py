"""`suite export`'s branches for issue 20's GGUF file and quantized HF folder, and the manifest of
the plain HF folder: suite.cli.verbs.export hands over here before its own format=hf path, so each format's
branch stays separate (torch_export and onnx sit beside these)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from suite.compress.checks import refuse_quantized
from suite.config.errors import ConfigError
from suite.export.checks import export_out
from suite.export.gguf import check_gguf_exportable, export_gguf, gguf_precision, refuse_quantized_source
from suite.export.manifest import max_logits_error, quiet_loading, sample_tokens, write_manifest
from suite.export.quantized_hf import check_quantized_hf, export_quantized_hf
from suite.folders import RECORD
from suite.models.quantized import quantized_info

OWN_FILES = ("export_manifest.json", RECORD)  # what the folder says of itself, not the artefact


def check_export_quantize(cfg: Any, source: Any) -> None:
    """export.quantize is a GGUF (and onnx) setting: format=hf writes the checkpoint's own precision;
    export.dtype is the plain HF folder's, so it is refused where it would be ignored."""
    e = cfg.export
    if e.format == "hf" and e.quantize is not None:
        raise ConfigError(
            f"export.quantize={e.quantize} with format=hf: an HF folder holds the checkpoint as it is; "
            f"quantize first (`suite quantize ckpt={cfg.ckpt} compress=int8`), then export that checkpoint with "
            "format=hf, or write format=gguf export.quantize=q8_0"
        )
    if e.dtype != "fp32" and e.format == "gguf":
        raise ConfigError(
            f"export.dtype={e.dtype} with format=gguf: a GGUF file's precision is export.quantize (f16, q8_0 "
            "or q4_0); leave export.dtype at fp32"
        )
    if e.dtype != "fp32" and e.format == "hf" and source.quantized:
        raise ConfigError(
            f"export.dtype={e.dtype} with the quantized ckpt='{cfg.ckpt}': its export keeps the checkpoint's own "
            "tensors; leave export.dtype at fp32"
        )


def export_gguf_or_quantized_hf(cfg: Any, source: Any) -> tuple[dict, str] | None:
    """format=gguf, or format=hf of a `suite quantize` checkpoint: (--json result, text); None when
    the plain format=hf path applies."""
    check_export_quantize(cfg, source)
    if cfg.export.format == "gguf":
        return _gguf(cfg, source)
    if cfg.export.format == "hf" and source.quantized:
        return _quantized_hf(cfg, source)
    return None


def _gguf(cfg: Any, source: Any) -> tuple[dict, str]:
    precision = gguf_precision(cfg.export.quantize)
    refuse_quantized_source(source)  # names the full-precision checkpoint it came from
    refuse_quantized(cfg.ckpt, "ckpt", "exporting to GGUF")  # LoRA over a quantized base (QLoRA)
    check_gguf_exportable(source.model_config(), source.named)
    if source.lora is not None and not cfg.export.merge_lora:
        raise ConfigError(
            f"ckpt='{cfg.ckpt}' was finetuned with LoRA; pass merge_lora=true to fold the adapters into the "
            "GGUF weights (the adapters alone are in <run.dir>/lora/)"
        )
    out = export_out(cfg, source)
    path, check = export_gguf(source, out, precision)
    _marker(out, source, "gguf")
    error = check["max_abs_logits_error"]
    result = {"out": str(out), "format": "gguf", "file": str(path), "precision": precision, **check}
    checked = (
        f"self-check: max |logits - suite| = {error:.3g} on {check['inputs']}, loaded with {check['loaded_with']}"
        if error is not None
        else f"self-check skipped: {check['skipped']}"
    )
    text = f"exported {source.folder} to {path} (GGUF {precision})\n{checked}\nmanifest: {out / 'export_manifest.json'}"
    return result, text


def _quantized_hf(cfg: Any, source: Any) -> tuple[dict, str]:
    check_quantized_hf(source, quantized_info(source.folder))
    out = export_out(cfg, source)
    _, check = export_quantized_hf(source, out)
    error = check["max_abs_logits_error"]
    result = {"out": str(out), "format": "hf", "quantized": True, **check}
    text = (
        f"exported {source.folder} to {out} (quantized; load with transformers.AutoModelForCausalLM.from_pretrained)\n"
        f"self-check: {check['quantized_tensors_identical']} torchao tensors identical, max |logits - suite| = "
        f"{error:.3g} on {check['inputs']}\nmanifest: {out / 'export_manifest.json'}"
    )
    return result, text


def hf_manifest(source: Any, out: Path, dtype: Any, load_bytes: int) -> dict:
    """The plain format=hf folder's manifest, with its logits self-check when the weights fit in
    `load_bytes` (what the export's load check holds at once); returns the verification."""
    # deferred: transformers costs seconds to import; only the export's load check needs it
    from transformers import AutoModelForCausalLM

    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    cfg = source.model_config()
    if weights <= load_bytes:
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        tokens = sample_tokens(cfg)
        check = {
            "max_abs_logits_error": max_logits_error(source.load_model(), model, tokens),
            "inputs": f"{tokens.shape[0]} x {tokens.shape[1]} seeded random tokens",
            "loaded_with": "transformers.AutoModelForCausalLM.from_pretrained(out)",
        }
    else:
        check = {
            "max_abs_logits_error": None,
            "skipped": f"weights of {weights} bytes exceed export.max_shard_mb",
        }
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in OWN_FILES)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    write_manifest(out, format="hf", precision=precision, source=source, files=files, verification=check)
    return check


def _marker(out: Path, source: Any, fmt: str) -> None:
    """suite_export.json: the folder is an export (suite.export.checks lets a later export reuse it)."""
    cfg = source.model_config()
    (out / "suite_export.json").write_text(
        json.dumps({"family": cfg.family, "name": cfg.name, "format": fmt}, indent=1)
    )
