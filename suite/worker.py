"""Entry point of a launched worker: read the parent's frozen config and run the verb."""

from __future__ import annotations

import sys
from pathlib import Path

from suite.config.compose import load_saved_config
from suite.config.validate import validate


def main(argv: list[str]) -> int:
    verb, config_path = argv[0], Path(argv[1])
    resolved_yaml = config_path.read_text()
    cfg = load_saved_config(config_path)
    dims = validate(cfg)
    if verb == "pretrain":
        from suite.train.trainer import Trainer

        Trainer(cfg, dims, resolved_yaml).train()
        return 0
    raise SystemExit(f"error: verb {verb!r} does not run under the launcher")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
