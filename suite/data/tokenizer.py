"""Byte-level BPE tokenizer training and loading.

Digits are split one per token (arithmetic-friendly, as in Llama/GPT-NeoX) and every byte is in
the base alphabet, so any text round-trips. `<|endoftext|>` (id 0) is EOS, BOS and the document
separator; `<|pad|>` pads. Saved both as a bare `tokenizer.json` and as a Hugging Face folder so
`AutoTokenizer.from_pretrained(folder)` works for export and evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from suite.config.errors import ConfigError
from suite.data.gguf_metadata import GGUFMetadata

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]
TOKENIZER_FILE = "tokenizer.json"
# End-of-document tokens of common tokenizers, for a reused tokenizer.json that does not name one.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def new_bpe() -> Tokenizer:
    """An untrained tokenizer with the suite's normalisation pipeline."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Path:
    """Train a byte-level BPE of at most `vocab_size` tokens on `texts`; save it into `out_dir`.

    Deterministic for the same texts in the same order. Returns the tokenizer.json path.
    """
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is too small for a byte-level tokenizer; "
            f"use at least {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return save_tokenizer(tok, out_dir)


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> Path:
    """Write tokenizer.json plus the Hugging Face config files, with eos/bos/pad set."""
    # deferred: transformers costs seconds to import; suite --help imports this module (suite.data) and never saves a tokenizer
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = _find_eos(tok)
    pad = PAD_TOKEN if tok.token_to_id(PAD_TOKEN) is not None else eos
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=pad)
    hf.save_pretrained(str(out_dir))
    path = out_dir / TOKENIZER_FILE
    tok.save(str(path))  # the exact trained object, whatever save_pretrained chose to rewrite
    return path


def _find_eos(tok: Tokenizer) -> str | None:
    for candidate in _EOS_CANDIDATES:
        if tok.token_to_id(candidate) is not None:
            return candidate
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer folder (HF files or just tokenizer.json), a tokenizer.json file, or a llama.cpp
    .gguf file (the tokenizer its metadata holds, as a `gguf:` model source reads it).

    Raises ConfigError naming the path when it is missing or unreadable.
    """
    # deferred: transformers costs seconds to import; suite --help imports this module (suite.data) and never loads a tokenizer
    from transformers import PreTrainedTokenizerFast

    path = Path(path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return GGUFMetadata(path, f"tokenizer '{path}'").tokenizer()
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"tokenizer '{path}' not found: expected a folder holding {TOKENIZER_FILE} or the file itself"
        )
    try:
        tok = Tokenizer.from_file(str(file))
        hf_config = file.name == TOKENIZER_FILE and (file.parent / "tokenizer_config.json").is_file()
        if hf_config:  # keeps the folder's own settings (special tokens, chat template, max length)
            hf = PreTrainedTokenizerFast.from_pretrained(str(file.parent))
        else:
            eos = _find_eos(tok)
            pad = PAD_TOKEN if tok.token_to_id(PAD_TOKEN) is not None else eos
            hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=pad)
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        reason = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise ConfigError(
            f"tokenizer '{file}' could not be loaded ({reason}); "
            "re-run `suite prepare` or point data.tokenizer at a working tokenizer folder"
        ) from err
    if hf.eos_token is None and _find_eos(tok) is not None:
        hf.eos_token = _find_eos(tok)
    if hf.pad_token is None and hf.eos_token is not None:
        hf.pad_token = hf.eos_token
    return hf
