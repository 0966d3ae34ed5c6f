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
import unicodedata
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
        elif token == f"[PAD{i}]":  # a padding row of a GGUF read back (transformers keeps it as a token)
            tokens.append(token)
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


# llama.cpp's pre-tokenizer names (llama-vocab.cpp) by the split they run: GPT-2's byte-level regex,
# or the same after every digit (Unicode category N) is split off on its own
GPT2_SPLIT = ("gpt-2", "mpt", "olmo", "jais", "trillion")
DIGITS_SPLIT = ("refact", "starcoder", "smollm", "command-r", "codeshell", "exaone", "minerva")


def _split_of(pre: str) -> str | None:
    return "gpt-2" if pre in GPT2_SPLIT else "refact" if pre in DIGITS_SPLIT else None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the inverse of its bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)
    return {c: b for b, c in chars.items()}


def digits_stand_alone(vocab: GgufVocab) -> bool:
    """No normal token holds a digit (Unicode category N) beside another character: splitting digits off
    first then gives the tokens GPT-2's split gives, and the two llama.cpp splits agree."""
    decode = _byte_decoder()
    for token, kind in zip(vocab.tokens, vocab.types):
        if kind != NORMAL or len(token) < 2:
            continue
        text = bytes(decode[c] for c in token if c in decode).decode("utf-8", errors="ignore")
        if len(text) > 1 and any(unicodedata.category(c).startswith("N") for c in text):
            return False
    return True


def source_pre(vocab: GgufVocab, pre: Any) -> GgufVocab:
    """`vocab` under a GGUF source's own `tokenizer.ggml.pre` name (SmolLM2: 'smollm') where llama.cpp
    splits the same way under both names.

    transformers' rebuild of a GGUF tokenizer, which the suite reads, drops the digit split (it is
    detected as 'gpt-2'); GPT-2's split and the digit-first one ('refact', 'smollm') tokenize alike
    when no token holds a digit beside another character (SmolLM2's vocabulary). Otherwise the
    detected name stays and a note says which the source had."""
    if not isinstance(pre, str) or not pre or pre == vocab.pre:
        return vocab
    ours, theirs = _split_of(vocab.pre), _split_of(pre)
    if ours is not None and (ours == theirs or (theirs is not None and digits_stand_alone(vocab))):
        note = (
            f"tokenizer.ggml.pre='{pre}': the source GGUF's own name (llama.cpp splits this vocabulary alike)"
        )
        return dataclasses.replace(vocab, pre=pre, notes=(*vocab.notes, note))
    note = f"tokenizer.ggml.pre='{vocab.pre}': the source GGUF says '{pre}', which llama.cpp splits otherwise here"
    return dataclasses.replace(vocab, notes=(*vocab.notes, note))


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
