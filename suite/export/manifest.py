"""export_manifest.json: what an export folder holds and how it was checked, beside every artifact."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

MANIFEST = "export_manifest.json"


def config_hash(model_config) -> str:
    """sha256 of the model config as sorted JSON: two exports of the same architecture share it."""
    text = json.dumps(asdict(model_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(
    out: Path,
    *,
    format: str,
    precision: str,
    source,
    files: list[str],
    verification: dict,
    extra: dict | None = None,
) -> dict:
    """Write <out>/export_manifest.json (source: a suite.sources.ModelSource) and return it."""
    from suite.train.checkpoint import checkpoint_step

    tokenizer_files = sorted(
        p.name
        for p in Path(out).iterdir()
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))
    )
    manifest = {
        "format": format,
        "precision": precision,
        "files": list(files),
        "tokenizer": tokenizer_files,
        "source": {
            "ckpt": str(source.folder),
            "step": None if source.is_hf else checkpoint_step(source.folder),
            "hf": source.is_hf,
        },
        "config_sha256": config_hash(source.model_config()),
        "verification": verification,
        **(extra or {}),
    }
    path = Path(out) / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
