"""Held-out and calibration text for a model imported from outside the suite (`hf:<folder>`,
`gguf:<file>`), which brings no recipe of its own: the command's data section (data.path, a
data.sources list, else the embedded corpus), tokenized with the source's own tokenizer, so
calibrated methods (SmoothQuant, GPTQ, pruning) start from it and every report has a quality figure.

The source's tokenizer is saved once under data.cache_dir in a folder named by its content, and
prepared as data.tokenizer: the same model on the same text reuses the prepared shards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from suite.config.errors import ConfigError
from suite.data import ensure_prepared, load_tokenizer
from suite.data.prepare import cache_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def saved_tokenizer(tokenizer: Any, data_cfg: Any) -> Path:
    """The folder (under the data cache) holding `tokenizer` as save_pretrained writes it."""
    root = cache_root(data_cfg)
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".tokenizer-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    tokenizer.save_pretrained(str(work))
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (work / name).is_file():
            digest.update((work / name).read_bytes())
    final = root / f"tokenizer-{digest.hexdigest()[:12]}"
    if final.is_dir():
        shutil.rmtree(work, ignore_errors=True)
    else:
        work.rename(final)
    return final


def source_data(data_cfg: Any, tokenizer: Any, named: str) -> Any:
    """data_cfg with `path` set to prepared shards in `tokenizer`'s ids: data.path as given (refused in
    one line when its tokenizer is another one), or data.sources / the embedded corpus prepared with it."""
    if data_cfg.path:
        folder = ensure_prepared(data_cfg, progress=False)
        if load_tokenizer(folder).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"data.path='{data_cfg.path}' was prepared with another tokenizer than {named}'s; prepare "
                f"the text with the model's own (`suite prepare data.tokenizer=<its tokenizer folder>`), "
                "or give data.sources to have it prepared here"
            )
        return data_cfg
    with_own = replace(data_cfg, tokenizer=str(saved_tokenizer(tokenizer, data_cfg)))
    return replace(with_own, path=str(ensure_prepared(with_own, progress=False)))
