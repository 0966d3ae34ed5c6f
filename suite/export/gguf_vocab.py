"""The tokenizer a GGUF file carries: llama.cpp's "gpt2" (byte-level BPE) vocabulary as metadata.

A GGUF has no tokenizer.json: the tokens (one per embedding row, so the list is padded to the
model's vocabulary with `[PAD<i>]` entries of type UNUSED, as llama.cpp's converter pads), their
types (special tokens CONTROL, other added tokens USER_DEFINED), the merges and the special-token
ids are metadata, and the reader (llama.cpp, transformers' GGUF loader) rebuilds the tokenizer
from them and from `tokenizer.ggml.pre`, the name of the text split. The suite's tokenizer splits
digits one by one before GPT-2's byte-level split, which is llama.cpp's "refact" split; a plain
byte-level BPE is "gpt-2". transformers knows neither name and splits with GPT-2's rule, so there
numbers may tokenize differently (the manifest says so); all other text tokenizes the same. A GGUF
source keeps its own name (SmolLM2: 'smollm', llama.cpp's 'refact' split). The tokenizer's chat
template is written as `tokenizer.chat_template`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from suite.config.errors import ConfigError

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclasses.dataclass(frozen=True)
class GgufVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str  # tokenizer.ggml.pre
    padded: int  # [PAD<i>] entries added up to the model's vocabulary
    notes: tuple[str, ...] = ()


def gguf_vocab(tokenizer: Any, vocab_size: int, where: str) -> GgufVocab:
    """The GGUF vocabulary of a transformers fast tokenizer, padded to `vocab_size` rows; a
    ConfigError when it is not byte-level BPE or holds more tokens than the model embeds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model") or {}
    pre = json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        kind = model.get("type") or type(tokenizer).__name__
        raise ConfigError(
            f"{where}: its tokenizer is {kind}{'' if model.get('type') != 'BPE' else ' without a byte-level split'}; "
            "export.format=gguf writes llama.cpp's byte-level BPE ('gpt2') vocabulary only; use format=hf"
        )
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise ConfigError(
            f"{where}: its tokenizer has {len(vocab)} tokens (largest id {max(vocab.values())}), more than the "
            f"model's vocabulary ({vocab_size}); GGUF holds one token per embedding row: use format=hf"
        )
    added = {t["content"]: bool(t.get("special")) for t in spec.get("added_tokens", [])}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(token)
            types.append(NORMAL if token not in added else (CONTROL if added[token] else USER_DEFINED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    digits = '"individual_digits": true' in pre
    notes = ()
    if digits:
        notes = (
            "tokenizer.ggml.pre='refact' (digits one by one, then GPT-2's byte-level split) is the suite "
            "tokenizer's split in llama.cpp; transformers' GGUF tokenizer does not know it and keeps digits "
            "together, so numbers may tokenize differently there",
        )
    return GgufVocab(tokens, types, merges, "refact" if digits else "gpt-2", vocab_size - len(vocab), notes)


def source_pre(vocab: GgufVocab, pre: Any) -> GgufVocab:
    """`vocab` under a GGUF source's own `tokenizer.ggml.pre` name (SmolLM2: 'smollm').

    The vocabulary written is the file's own (its tokens and merges), so its split is the file's; the
    name only has to stay one llama.cpp gives the same split. transformers' rebuild of a GGUF
    tokenizer drops the split (a plain byte-level 'gpt-2' one), so the detected name is no evidence
    against the file's."""
    if not isinstance(pre, str) or not pre or pre == vocab.pre:
        return vocab
    note = f"tokenizer.ggml.pre='{pre}': the source GGUF's own split name, kept"
    return dataclasses.replace(vocab, pre=pre, notes=(*vocab.notes, note))


def chat_template_of(tokenizer: Any) -> str | list[dict[str, str]] | None:
    """The tokenizer's chat template as GGUF holds it: one string, or named templates (a list of
    {name, template}, the default as `tokenizer.chat_template`); None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return [{"name": name, "template": text} for name, text in template.items()] or None
    return template or None


def add_vocab(writer: Any, vocab: GgufVocab, special: dict[str, Any], chat_template: Any = None) -> None:
    """The tokenizer.ggml.* keys; `special`: bos/eos/pad ids inside the vocabulary (or None);
    `chat_template` (chat_template_of): `tokenizer.chat_template`, which llama.cpp's chat handlers
    render; without it they fall back to another model's chat format."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        value = special.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)  # the suite never prepends one: documents are separated by eos
    if chat_template is not None:
        writer.add_chat_template(chat_template)
