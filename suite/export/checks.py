"""`suite export`'s checks before anything is read or written: the output folder, and whether the
model's architecture fits the Hugging Face config it is written as."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import family_of, head_size
from suite.outputs import check_output_folder

MARKER = "suite_export.json"  # written into every export folder (suite.export.hf): reusing one is safe


def check_export_out(out: str | None) -> None:
    """export.out as typed (None: the default <run.dir>/export-<format>)."""
    if out is None:
        return
    if not str(out).strip():
        raise ConfigError(
            "export.out is empty; pass out=<a new folder>, or leave out= away for <run.dir>/export-hf"
        )
    check_output_folder(
        "export.out",
        out,
        f"pass out=<a new or empty folder, or an earlier export> instead of '{out}'",
        MARKER,
    )


def check_default_out(out: Path) -> None:
    check_output_folder("export.out", str(out), "pass out=<a new or empty folder>", MARKER)


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
    checked: a new or empty folder, or an earlier export."""
    check_export_out(cfg.export.out)
    if cfg.export.out:
        return Path(cfg.export.out)
    if source.run_dir is None:
        raise ConfigError(f"ckpt='{cfg.ckpt}' is an HF folder; pass out=<dir> for the exported copy")
    out = source.run_dir / f"export-{cfg.export.format}"
    check_default_out(out)
    return out
