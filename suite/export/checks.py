"""`suite export`'s checks before anything is read or written: the output folder, and whether the
model's architecture fits the Hugging Face config it is written as."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
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
    """GPT-2's HF config derives the head size as n_embd / n_head (transformers' GPT2Attention; no
    pruned_heads either): a GPT model whose heads are another size (suite prune prune.heads /
    prune.hidden) cannot be written as GPT2LMHeadModel. Llama-family configs carry head_dim."""
    from suite.models.transformer import head_size

    if cfg.family != "gpt" or cfg.hidden_size == cfg.num_heads * head_size(cfg):
        return
    raise ConfigError(
        f"model.head_dim={head_size(cfg)} with model.hidden_size={cfg.hidden_size} and model.num_heads="
        f"{cfg.num_heads}: GPT-2's Hugging Face config cannot hold a head size other than hidden_size / "
        "num_heads, so this pruned GPT model does not export (it runs in the suite: generate, eval, finetune, "
        "distill); export a GPT pruned with prune.ffn / prune.layers only, or prune heads on a llama-family model"
    )
