"""`suite export format=hf`: a folder that transformers' AutoModelForCausalLM loads with no custom code.

The names, transposes and fusions are suite.models.hf_mapping's mapping; the weights come from a model
source (suite.model_source) as lazy tensors, so a checkpoint from any parallel layout (LoRA adapters
folded in) or another HF folder converts one tensor at a time, holding at most one output shard
of `max_shard_bytes` in memory. Config files are written through transformers' own classes, with
the source's special-token ids (suite.export.special: never one outside the vocabulary), and the
written folder is checked the way a user loads it (suite.export.verify).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from suite.config.schema import ModelConfig
from suite.export.checks import check_hf_exportable
from suite.export.special import SpecialIds, imported_ids, in_vocabulary, tokenizer_ids
from suite.export.verify import verify_hf_folder
from suite.model_source import ModelSource
from suite.models.hf_mapping import hf_config, on_disk_names, to_hf_state_dict
from suite.models.lazy import LazyTensor, as_lazy

MAX_SHARD_BYTES = 2 * 1024**3


def export_hf(model, cfg: ModelConfig, out: Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> Path:
    """Write a folder that AutoModelForCausalLM/AutoTokenizer.from_pretrained load with no custom code,
    and check that they do."""
    write_hf_folder(cfg, model.state_dict(), out, tokenizer, dtype)
    verify_hf_folder(out, cfg.vocab_size)
    return out


def write_hf_folder(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor | LazyTensor],
    out: Path,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    special: SpecialIds | None = None,
) -> Path:
    """The HF folder for suite-named `weights` (tensors, or lazy tensors read one shard at a time).

    `special`: the special-token ids to write (the source's); by default the tokenizer's, each only
    when it is inside the vocabulary. Unchecked: the callers that report an export verify it."""
    # deferred: transformers costs seconds to import; only writing the HF folder's generation config needs it
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_hf_exportable(cfg)
    if special is None:
        ids = tokenizer_ids(tokenizer)
        special = in_vocabulary(ids, ids, cfg.vocab_size)
    config = hf_config(cfg)
    config.update(special.config)
    config.dtype = dtype
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    hf_sd = on_disk_names(cfg, to_hf_state_dict(cfg, dict(weights)))
    if cfg.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)  # tied: saved once, as the embedding (as transformers does)
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(hf_sd, out, dtype, max_shard_bytes)
    config.save_pretrained(out)
    GenerationConfig(**special.generation).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    marker = {"family": cfg.family, "name": cfg.name, "special_ids_left_out": list(special.notes)}
    (out / "suite_export.json").write_text(json.dumps(marker, indent=1))
    return out


def export_checkpoint_hf(
    ckpt: str | Path | ModelSource,
    out: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> tuple[Path, tuple[str, ...]]:
    """`suite export`: a suite checkpoint (any layout wrote it; LoRA adapters merged) or an hf:
    folder, streamed tensor by tensor into an HF folder, then verified. Returns the folder read and
    a note for each special-token id left out (outside the vocabulary)."""
    source = ModelSource.parse(ckpt, "ckpt")
    tokenizer = source.tokenizer(required=not source.is_hf)
    cfg = source.model_config()
    if source.is_hf:  # its own ids: its tokenizer may hold tokens past the model's vocabulary
        special = in_vocabulary(*imported_ids(source), cfg.vocab_size)
    else:
        ids = tokenizer_ids(tokenizer)
        special = in_vocabulary(ids, ids, cfg.vocab_size)
    with source.weights() as weights:
        write_hf_folder(cfg, weights, out, tokenizer, dtype, max_shard_bytes, special)
    verify_hf_folder(out, cfg.vocab_size, load_bytes=max_shard_bytes)  # no more than one shard held
    return source.folder, special.notes


def write_hf_weights(
    hf_sd: Mapping[str, LazyTensor | torch.Tensor],
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json when
    the weights exceed `max_shard_bytes`; reads each tensor when its shard is written."""
    groups: list[list[str]] = [[]]
    size = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, value in hf_sd.items():
        nbytes = value.numel() * itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(groups, 1):
        file = out / (
            "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        shard = {n: as_lazy(hf_sd[n]).read().to(dtype).contiguous() for n in names}
        save_file(shard, str(file), metadata={"format": "pt"})
        file.chmod(_file_mode())  # safetensors writes 0600; the other files of the folder follow the umask
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(names, file.name))
        files.append(file)
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def _file_mode() -> int:
    """The mode a plain open() gives a new file: 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
