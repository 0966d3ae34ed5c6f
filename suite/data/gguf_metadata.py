"""A llama.cpp GGUF file's metadata: its architecture name, fields and tokenizer (with the chat
template). What the data layer needs from a `.gguf` (`data.tokenizer=<file>.gguf`), apart from the
model side (suite.gguf_file: family, config, weights), so that suite.data imports no model code.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError

SPECIAL_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "padding_token_id",
}


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' GGUF reader logs and warns per call (dequantization notices); the source
    describes itself in one line instead."""
    # deferred: transformers costs seconds to import; only a GGUF source's config and tokenizer need it
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


class GGUFMetadata:
    """One GGUF file, parsed once (metadata and tensor index; the data stays memory-mapped)."""

    def __init__(self, path: Path, where: str):
        self.path, self.where = Path(path), where
        # deferred: gguf is optional (the deploy extra); only a GGUF source needs it
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as exc:  # noqa: BLE001 (any parse failure is a damaged file, said in one line)
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{where}: not a readable GGUF file ({detail[:160]})") from None
        self.arch = self.field("general.architecture")
        if not isinstance(self.arch, str):
            raise ConfigError(f"{where}: not a readable GGUF file (no general.architecture)")

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, list), or `default` when absent."""
        found = self.reader.fields.get(key)
        if found is None:
            return default
        try:
            return found.contents()
        except Exception:  # noqa: BLE001 (a damaged field reads as absent; the tensors decide)
            return default

    def arch_fields(self) -> dict[str, Any]:
        """The `<arch>.*` hyper-parameters, the prefix removed (`context_length`, `attention.key_length`)."""
        prefix = f"{self.arch}."
        return {k[len(prefix) :]: self.field(k) for k in self.reader.fields if k.startswith(prefix)}

    @contextlib.contextmanager
    def transformers_reading(self) -> Iterator[None]:
        """transformers' GGUF config and tokenizer readers, quiet, handed this file's parsed reader
        instead of parsing the file again (each parse walks every token and merge string: SmolLM2's
        three parses took 21 of the 67 s before its weights were read, 1-thread profile,
        docs/benchmarks.md). transformers imports gguf.GGUFReader inside its functions, so it is
        swapped on the gguf module for the call only."""
        # deferred: gguf is optional (the deploy extra); only a GGUF source needs it
        import gguf

        original, path = gguf.GGUFReader, self.path.resolve()

        def parsed_once(file: Any, *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs and Path(file).resolve() == path:
                return self.reader
            return original(file, *args, **kwargs)

        gguf.GGUFReader = parsed_once
        try:
            with quiet_transformers():
                yield
        finally:
            gguf.GGUFReader = original

    def tokenizer(self) -> Any:
        """transformers' tokenizer rebuilt from the metadata (with the file's chat template)."""
        # deferred: transformers costs seconds to import; only a GGUF source's tokenizer needs it
        from transformers import AutoTokenizer

        try:
            with self.transformers_reading():
                return AutoTokenizer.from_pretrained(
                    self.path.parent, gguf_file=self.path.name, trust_remote_code=False
                )
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise ConfigError(f"{self.where}: its tokenizer cannot be rebuilt ({exc})") from None

    def special_ids(self) -> dict[str, int | None]:
        """bos/eos/pad ids as the file's metadata holds them (config.json's keys)."""
        return {ours: self.field(f"tokenizer.ggml.{theirs}") for ours, theirs in SPECIAL_KEYS.items()}
