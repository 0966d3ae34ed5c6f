"""What a finished stage left behind: a fingerprint of its outputs (verified before a stage is
skipped), and the figures its result gives (accuracy, perplexity, size, decode speed).

A run-folder stage (pretrain, finetune, distill, quantize, prune) is fingerprinted by the checkpoint
`suite.model_source.ModelSource.parse` finds in it (every file checked against the checkpoint's manifest)
and that manifest's sha256; an export or prepare stage by the sha256 of every file it wrote; an eval or
generate stage by its result.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError
from suite.model_source import ModelSource
from suite.models import build_model
from suite.pipeline.recipe import Stage
from suite.train.checkpoint import MANIFEST, checkpoint_step

RESULT = "result.json"  # an eval / generate stage's JSON result, in its folder
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".onnx", ".data", ".pt2", ".bin")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(stage: Stage) -> dict[str, Any]:
    """The stage's outputs as they are now; ConfigError (one line) when they are missing or broken."""
    folder = stage.folder
    if stage.output in ("run", "checkpoint"):
        source = ModelSource.parse(str(folder), f"stage {stage.name}")
        return {
            "checkpoint": str(source.folder),
            "step": checkpoint_step(source.folder),
            "manifest_sha256": sha256(source.folder / MANIFEST),
        }
    if not folder.is_dir():
        raise ConfigError(f"{folder} is missing")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ConfigError(f"{folder} is empty")
    return {"files": {str(p.relative_to(folder)): sha256(p) for p in files}}


def describe(output: dict[str, Any]) -> str:
    if "step" in output:
        return f"step {output['step']}, {output['checkpoint']}, verified"
    return f"{len(output['files'])} files, sha256 verified"


def read_result(stage: Stage, printed: dict[str, Any] | None) -> dict[str, Any]:
    """The stage's result: the verb's --json line; a training verb's summary.json."""
    if stage.output == "run":
        summary = stage.folder / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else {}
    return printed or {}


def _params(folder: Path) -> int | None:
    """Parameters of the model a run folder's newest checkpoint holds (built on the meta device)."""
    try:
        model = build_model(ModelSource.parse(str(folder)).model_config(), "meta")
        return sum(p.numel() for p in model.parameters())
    except Exception:  # a figure for the report, never a reason to stop the pipeline
        return None


def _from_report(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "accuracy": row.get("task_accuracy"),
        "perplexity": row.get("perplexity"),
        "params": row.get("params"),
        "bytes": row.get("file_bytes"),
        "decode_tokens_per_s": row.get("decode_tokens_per_s"),
    }


def figures(stage: Stage, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{model stage: {metric: value}}: what this stage's result says about which stage's model.
    An eval stage's figures belong to the stage it measured; a quantize / prune report's `after`
    to itself and its `before` to the stage it read (figures an eval stage gives win over both)."""
    out: dict[str, dict[str, Any]] = {}
    measured = {k: result.get(k) for k in ("accuracy", "perplexity") if k in result}
    if stage.output == "result" and stage.measures and measured:
        out[stage.measures] = measured
    elif stage.output == "checkpoint":
        out[stage.name] = _from_report(result.get("after") or {})
        if stage.needs:
            out[stage.needs[0]] = _from_report(result.get("before") or {})
    elif stage.output == "run":
        params = _params(stage.folder)
        out[stage.name] = {
            "accuracy": result.get("last_val_accuracy"),
            "params": params,
            "bytes": None if params is None else 4 * params,  # fp32 weights
        }
    elif stage.output == "files":
        files = [p for p in stage.folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
        out[stage.name] = {"bytes": sum(p.stat().st_size for p in files) or None}
    return {k: {m: v for m, v in row.items() if v is not None} for k, row in out.items()}


def merge(table: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], stage: Stage) -> None:
    """Add a stage's figures: an eval stage's overwrite; a report's `before` only fills gaps."""
    for name, row in new.items():
        current = table.setdefault(name, {})
        for metric, value in row.items():
            if stage.output == "result" or name == stage.name or metric not in current:
                current[metric] = value
