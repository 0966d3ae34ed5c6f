"""The data section's checks that need more than one key or the file system (before launch)."""

from __future__ import annotations

import shlex
from pathlib import Path

from suite import user_files
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.output_paths import instead


def check_data(cfg: SuiteConfig, needs_data: bool = True) -> None:
    """Sequences fit the model; a prepared data.path exists when the verb reads it."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    data_path = cfg.data.path
    if not needs_data:
        return
    if data_path is not None and not str(data_path).strip():
        raise ConfigError(
            "data.path is empty; give a prepared data folder, or data.path=null for the embedded corpus"
        )
    if data_path is not None and not cfg.data.sources:
        folder = Path(data_path).expanduser()
        if folder.is_file():
            prepared = instead(folder.with_name(f"{folder.stem}-prepared"))
            sources = shlex.quote(f"data.sources=[{{path: {data_path}}}]")
            raise ConfigError(
                f"data.path='{data_path}' is a file, not the folder suite prepare writes; run "
                f"`suite prepare data=local {sources} data.vocab_size={cfg.model.vocab_size} "
                f"data.path={prepared}` first and pass data.path={prepared}"
            )
        if not folder.is_dir():
            raise ConfigError(
                f"data.path='{data_path}' does not exist; run `suite prepare data.path={data_path}` (the "
                "embedded corpus) first, or drop data.path= to read the embedded corpus"
            )
        if not (folder / "meta.json").is_file():
            raise ConfigError(
                f"data.path='{data_path}' is not a prepared data folder (no meta.json); drop data.path= "
                f"to read the embedded corpus, or prepare your files there with `suite prepare` (docs/data.md)"
            )
        meta = user_files.read_json(folder / "meta.json", f"data.path='{data_path}'")
        if not isinstance(meta, dict):
            raise ConfigError(
                f"data.path='{data_path}' has a meta.json that is not a JSON object; run `suite prepare` again"
            )
        vocab = meta.get("vocab_size")
        where = f"the tokenizer in data.path='{data_path}'"
    elif cfg.data.tokenizer:  # reused, not trained: its size is checked once prepared (meta.json)
        vocab, where = None, ""
    else:
        vocab, where = cfg.data.vocab_size, f"data.vocab_size={cfg.data.vocab_size}"
    if vocab is not None and vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"{where} has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size={vocab} (or more)"
        )


def check_prepare(cfg: SuiteConfig) -> None:
    """`suite prepare`'s keys, before any corpus is built or tokenizer trained."""
    d = cfg.data
    if d.vocab_size < 258:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} is too small for a byte-level tokenizer; use at least 258 "
            "(256 bytes + 2 special tokens), e.g. data.vocab_size=8192"
        )
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction={d.val_fraction} must be in [0, 1), e.g. data.val_fraction=0.02"
        )
    if d.path is not None and not str(d.path).strip():
        raise ConfigError("data.path is empty; name the folder to write, e.g. data.path=data/prepared")
    if d.path is not None and Path(d.path).expanduser().is_file():
        raise ConfigError(f"data.path='{d.path}' is a file; name a new folder for the prepared data")
    if d.tokenizer and not Path(d.tokenizer).expanduser().exists():
        raise ConfigError(
            f"data.tokenizer='{d.tokenizer}' does not exist; give a tokenizer.json (or its folder) or a "
            ".gguf file, or drop data.tokenizer to train one"
        )
