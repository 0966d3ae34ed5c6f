"""export_manifest.json: what an export wrote, from what, and how close it computes to the source.

Every export format writes one (hf, gguf, and the quantized HF folder; torch_export and onnx call
the same function), so a person holding only the artifact can tell which checkpoint and step it
came from, whether its architecture is the one they expect (the config hash: sha256 of the
resolved model config as sorted JSON), and the self-check made right after writing it (the
largest absolute logits difference of the artifact, loaded the way a user loads it, from the
suite model on sample inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from suite.models.transformer import ffn_size, head_size, kv_heads
from suite.train.checkpoint import checkpoint_step

MANIFEST_FILE = "export_manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def config_hash(model_config: Any) -> str:
    """sha256 of the resolved model config (a dataclass) as sorted JSON."""
    data = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else dict(model_config)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def model_summary(model_config: Any) -> dict[str, Any]:
    """The shapes a reader checks first: family, layers, widths, heads, vocabulary."""
    c = model_config
    return {
        "family": c.family,
        "name": c.name,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_heads": c.num_heads,
        "num_kv_heads": kv_heads(c),
        "head_dim": head_size(c),
        "ffn_hidden_size": ffn_size(c),
        "vocab_size": c.vocab_size,
        "max_seq_len": c.max_seq_len,
        "tie_embeddings": c.tie_embeddings,
    }


def write_manifest(
    out: Path,
    *,
    format: str,
    precision: str,
    source: Any,
    files: list[str],
    verification: dict,
    extra: dict | None = None,
) -> Path:
    """Write <out>/export_manifest.json. `source`: the suite.model_source.ModelSource exported; `files`:
    the artifact's files, relative to `out` (their sizes are recorded); `verification`: the
    self-check, e.g. {"max_abs_logits_error": 3e-4, "inputs": "2 x 32 tokens", "loaded_with": ...};
    `extra`: format-specific entries (tensor types, notes)."""
    out = Path(out)
    cfg = source.model_config()
    manifest = {
        "format": format,
        "precision": precision,
        "files": {name: (out / name).stat().st_size for name in files if (out / name).is_file()},
        "tokenizer_files": [name for name in files if name in TOKENIZER_FILES],
        "source": {
            "ckpt": source.text,
            "path": str(source.folder),
            "step": _step(source),
            "hugging_face_folder": bool(source.is_hf and not getattr(source, "gguf", False)),
            "gguf_file": bool(getattr(source, "gguf", False)),
        },
        "model": model_summary(cfg),
        "config_sha256": config_hash(cfg),
        "verification": verification,
        **(extra or {}),
    }
    path = out / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return path


def _step(source: Any) -> int | None:
    if source.is_hf:
        return None
    try:
        return checkpoint_step(source.folder)
    except ValueError:  # a folder named otherwise, with no manifest step
        return None


def sample_tokens(model_config: Any, batch: int = 2, length: int = 32):
    """The self-check's inputs: fixed pseudo-random token ids (seed 0), every export the same."""
    generator = torch.Generator().manual_seed(0)
    length = min(length, model_config.max_seq_len)
    return torch.randint(0, model_config.vocab_size, (batch, length), generator=generator)


def max_logits_error(suite_model: Any, hf_model: Any, tokens: Any) -> float:
    """max |logits of `hf_model` - logits of the suite model| on `tokens` (both in fp32 eval)."""
    with torch.no_grad():
        ref = suite_model(tokens).float()
        got = hf_model(tokens).logits.float()
    return float((got - ref).abs().max())


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' and its GGUF reader's progress bars off while the self-check loads the
    artifact: the verb's output stays its own."""
    # deferred: transformers costs seconds to import; only the export's load check needs it
    import transformers.modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    bar = gguf_reader.tqdm  # the GGUF reader's own tqdm, which transformers' switch does not reach
    gguf_reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_reader.tqdm = bar
        if bars:
            logging.enable_progress_bar()
