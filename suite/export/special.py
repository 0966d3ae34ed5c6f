"""The special-token ids an export writes into config.json and generation_config.json.

They come from the source, never from a guess: an HF folder keeps its own config.json's and
generation_config.json's ids, because its tokenizer may add tokens after the model's vocabulary (a
Qwen2 folder whose `<|endoftext|>` is id vocab_size), and such an id written as pad_token_id makes
transformers refuse the folder ("Padding_idx must be within num_embeddings"). A suite run's ids are
its tokenizer's: the suite's own tokenizer opens and closes a document with its end-of-text token (bos =
eos), a run made from an imported model keeps that model's bos (SmolLM2's `<|im_start|>`, id 1, not its
eos 2). Whatever the source, an id outside
[0, vocab_size) is left out of the export, and a note says which and why.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
TokenId = int | list[int] | None
Ids = dict[str, TokenId]


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """What the export writes: `config` into config.json, `generation` into generation_config.json;
    `notes` name every id that was left out because it is outside the vocabulary."""

    config: Ids
    generation: Ids
    notes: tuple[str, ...] = ()


def tokenizer_ids(tokenizer: Any) -> Ids:
    """A suite run's ids, its tokenizer's: bos is the tokenizer's own (an imported model's, which a run
    made from it keeps), else the end-of-text token, which opens and closes a document in the suite."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return {"bos_token_id": eos if bos is None else bos, "eos_token_id": eos, "pad_token_id": pad}


def hf_folder_ids(folder: Path) -> tuple[Ids, Ids]:
    """An HF folder's own ids, as its files hold them: config.json's, and generation_config.json's
    (config.json's when it has none, as transformers derives it)."""
    config = _read_ids(folder / "config.json")
    generation = folder / "generation_config.json"
    return config, (_read_ids(generation) if generation.is_file() else dict(config))


def imported_ids(source: Any) -> tuple[Ids, Ids]:
    """An imported source's own ids (suite.model_source.ModelSource with is_hf): an HF folder's files
    (hf_folder_ids), a GGUF file's tokenizer.ggml.* metadata."""
    if getattr(source, "gguf", False):
        ids = source.gguf_file.special_ids()
        return ids, dict(ids)
    return hf_folder_ids(source.folder)


def _read_ids(path: Path) -> Ids:
    values = json.loads(path.read_text())
    return {key: values.get(key) for key in KEYS}


def in_vocabulary(config: Ids, generation: Ids, vocab_size: int) -> SpecialIds:
    """`config` and `generation` without any id outside [0, vocab_size): a list (several eos ids)
    keeps its members that are inside; a note names each id left out."""
    notes: list[str] = []

    def keep(file: str, ids: Ids) -> Ids:
        out: Ids = {}
        for key in KEYS:
            value = ids.get(key)
            values = value if isinstance(value, list) else [value]
            outside = [v for v in values if v is not None and not _inside(v, vocab_size)]
            if outside:
                notes.append(
                    f"{file} {key}={value} is outside the model's vocabulary (vocab_size {vocab_size}); "
                    f"left out of the export: {', '.join(map(str, outside))}"
                )
            kept = [v for v in values if v is not None and _inside(v, vocab_size)]
            out[key] = kept if isinstance(value, list) and kept else (kept[0] if kept else None)
        return out

    return SpecialIds(keep("config.json", config), keep("generation_config.json", generation), tuple(notes))


def _inside(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def outside_vocabulary(folder: Path, vocab_size: int) -> list[str]:
    """Every special id in a written folder's config.json and generation_config.json that is not
    below `vocab_size` (the export's self-check: none may be)."""
    problems = []
    for file in ("config.json", "generation_config.json"):
        if not (folder / file).is_file():
            continue
        for key, value in _read_ids(folder / file).items():
            values = value if isinstance(value, list) else [value]
            if any(v is not None and not _inside(v, vocab_size) for v in values):
                problems.append(f"{file} {key}={value} (vocab_size {vocab_size})")
    return problems
