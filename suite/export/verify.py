"""The export's self-check, run on the folder once it is written: what a user's
`AutoModelForCausalLM.from_pretrained(out)` would do, so that a folder transformers refuses is never
reported as exported.

Checked: every special-token id in config.json and generation_config.json is inside the vocabulary,
and the folder loads with no missing, unexpected or mismatched weights. Loading holds the whole
model in memory, which the streaming export otherwise never does: `suite export` loads it only when
the weights fit in one output shard (export.max_shard_mb, what the export held at once anyway);
above that the model is only built from the written config on the meta device (no memory; it still
catches a config transformers cannot build, such as a pad id outside the embedding).
"""

from __future__ import annotations

from pathlib import Path

import torch

from suite.export.special import outside_vocabulary

LOAD_BYTES = 1024**3


class ExportCheckFailed(RuntimeError):
    """The written folder is not what transformers loads: a bug in the export, not in the input."""


def verify_hf_folder(out: Path, vocab_size: int, load_bytes: int = LOAD_BYTES) -> None:
    """Raise ExportCheckFailed naming what is wrong with the HF folder `out`."""
    problems = outside_vocabulary(out, vocab_size)
    if problems:
        raise ExportCheckFailed(f"{out}: special-token ids outside the vocabulary: {'; '.join(problems)}")
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    try:
        if weights <= load_bytes:
            _load(out)
        else:
            _build_on_meta(out)
    except ExportCheckFailed:
        raise
    except Exception as exc:  # whatever transformers raises is the finding
        raise ExportCheckFailed(f"{out} does not load in transformers: {type(exc).__name__}: {exc}") from exc


def _load(out: Path) -> None:
    # deferred: transformers costs seconds to import; only the export's load check needs it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # the verb's output stays its own
    try:
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    finally:
        if bars:
            logging.enable_progress_bar()
    del model
    wrong = {key: sorted(map(str, value)) for key, value in info.items() if value}
    if wrong:
        raise ExportCheckFailed(f"{out}: transformers loads it with {wrong}")


def _build_on_meta(out: Path) -> None:
    # deferred: transformers costs seconds to import; only the export's load check needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out, trust_remote_code=False))
