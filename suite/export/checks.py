"""`suite export`'s checks before anything is read or written: the output folder, and whether the
model's architecture fits the Hugging Face config it is written as."""

from __future__ import annotations

import json
from pathlib import Path

from suite import folders
from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import family_of, head_size
from suite.output_paths import check_output_folder

MARKER = "suite_export.json"  # written into every export folder (suite.export.hf): reusing one is safe
OWNED = (MARKER, folders.RECORD)  # either marks an export's folder (made_by.json: one being written)


def check_export_out(out: str | None) -> None:
    """export.out as typed (None: the default <run.dir>/export-<format>)."""
    if out is None:
        return
    if not str(out).strip():
        raise ConfigError(
            "export.out is empty; drop out= to write the run folder's export-<format>, or pass a folder"
        )
    check_output_folder(
        "export.out",
        out,
        f"pass out={{folder}} (a new folder) instead of '{out}'",
        OWNED,
    )


def check_default_out(out: Path) -> None:
    check_output_folder("export.out", str(out), "pass out={folder} (a new folder)", OWNED)


def check_hf_exportable(cfg: ModelConfig) -> None:
    """What the Hugging Face config can hold after `suite prune`: the family's own limits (GPT-2's
    derives the head size as n_embd / n_head), and transformers 5 refuses
    every config whose hidden size is not a multiple of its head count (validate_architecture), even
    where a llama-family config carries head_dim. Both are refused here in one line, before anything
    is written, rather than as a traceback from transformers."""
    heads, size = cfg.num_heads, head_size(cfg)
    problem = family_of(cfg).hf.export_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.hidden_size % heads:
        raise ConfigError(
            f"model.hidden_size={cfg.hidden_size} with model.num_heads={heads}: transformers' {cfg.family} config "
            "requires the hidden size to be a multiple of the head count, so this pruned model does not export "
            "(it runs in the suite: generate, eval, finetune, distill); prune the hidden channels with the "
            f"heads (e.g. prune.hidden = prune.heads: hidden {heads * size} for {heads} heads of {size})"
        )


def export_out(cfg, source) -> Path:
    """export.out, or <run.dir>/export-<format> for a suite run (an HF folder needs out=); both
    checked: a new or empty folder, or an export of the same source with the same settings (another
    is refused, or moved aside with --overwrite: suite.folders.claim). Called when every other check
    has passed; `record_export` writes the record once the export has succeeded."""
    check_export_out(cfg.export.out)
    if cfg.export.out:
        out = Path(cfg.export.out).expanduser()
    elif source.run_dir is None:
        copy = source.folder.with_name(f"{source.folder.name}-export")
        copy = folders.new_folder(copy) if copy.exists() else copy
        raise ConfigError(f"ckpt='{cfg.ckpt}' is an HF folder; pass out={copy} for the exported copy")
    else:
        out = source.run_dir / f"export-{cfg.export.format}"
        check_default_out(out)
    folders.claim(
        out, made_by(cfg, source), "export.out", cfg.train.overwrite, legacy=_legacy, reads=(source.folder,)
    )
    return out


def record_export(cfg, source, out: Path) -> None:
    """made_by.json of a finished export (a refusal on the way, e.g. a missing tokenizer, leaves no
    folder behind)."""
    folders.write_record(out, made_by(cfg, source))


def made_by(cfg, source) -> dict:
    """What an export folder records (suite.folders): the source on disk and the settings that make
    the artefact (the shard size only where it applies: format=hf)."""
    e = cfg.export
    settings = {
        "export.format": e.format,
        "export.quantize": e.quantize,
        "export.dtype": e.dtype,
        "export.merge_lora": e.merge_lora,
    }
    if e.format == "hf":
        settings["export.max_shard_mb"] = e.max_shard_mb
    return folders.made_by("export", folders.source_identity(source.folder, source.is_hf), settings)


def _legacy(folder: Path) -> dict | None:
    """An export written before made_by.json: its suite_export.json names the format (hf when it
    names none: the plain HF folder's did not)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return {"verb": "export", "settings": {"export.format": marker.get("format", "hf")}}
