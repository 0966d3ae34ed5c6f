"""The data section's checks that need more than one key or the file system (before launch)."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig


def check_data(cfg: SuiteConfig, needs_data: bool = True) -> None:
    """Sequences fit the model; a prepared data.path exists when the verb reads it."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    data_path = cfg.data.path
    if (
        needs_data
        and data_path is not None
        and not cfg.data.sources
        and not Path(data_path).expanduser().is_dir()
    ):
        raise ConfigError(
            f"data.path='{data_path}' does not exist; run `suite prepare data.path={data_path} ...` "
            "first, or drop data.path to use the embedded corpus"
        )
