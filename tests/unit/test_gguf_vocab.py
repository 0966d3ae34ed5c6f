"""A GGUF source's pre-tokenizer name on export (suite.export.gguf_vocab.source_pre): kept where
llama.cpp splits the vocabulary the same way under it as under the name detected from the tokenizer."""

from __future__ import annotations

from suite.export.gguf_vocab import NORMAL, GgufVocab, _byte_decoder, source_pre

ENCODE = {b: c for c, b in _byte_decoder().items()}


def _bytelevel(text: str) -> str:
    """`text` as a byte-level BPE token spells it (' 1' -> 'Ġ1')."""
    return "".join(ENCODE[b] for b in text.encode())


def _vocab(tokens: list[str], pre: str = "gpt-2") -> GgufVocab:
    return GgufVocab(tokens, [NORMAL] * len(tokens), [], pre, 0)


def test_the_source_name_is_kept_where_the_split_is_the_same():
    """SmolLM2's case: transformers' rebuild says gpt-2, the file smollm (digits split off first); no
    token holds a digit beside another character, so both splits give the same tokens."""
    vocab = _vocab(["a", "Ġ", "1", "2", "Ġthe", _bytelevel("一个")])  # 一 is a letter (Lo), not a digit
    assert source_pre(vocab, "smollm").pre == "smollm"
    assert source_pre(_vocab(["a"], "refact"), "starcoder").pre == "starcoder"  # one split, two names


def test_the_detected_name_stays_where_llama_cpp_would_split_otherwise():
    """A token with a digit beside another character (' 1', '12', 'x٣') is made by GPT-2's split and
    never by the digit-first one: the names would tokenize differently, so the detected one stays and
    a note names the source's; a name of another split family (qwen2) is not taken either."""
    for text in (" 1", "12", "x٣"):  # ٣: Arabic-Indic three (category Nd)
        kept = source_pre(_vocab(["a", _bytelevel(text)]), "smollm")
        assert kept.pre == "gpt-2" and "smollm" in kept.notes[-1], text
    assert source_pre(_vocab(["a"]), "qwen2").pre == "gpt-2"
    assert source_pre(_vocab(["a"]), None).pre == "gpt-2"
