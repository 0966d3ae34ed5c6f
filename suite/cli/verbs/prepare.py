"""`suite prepare`: a tokenizer and packed token shards from text files or datasets."""

from __future__ import annotations

import json
from pathlib import Path

from suite.cli.common import _compose, _report
from suite.folders import OVERWRITE
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    _, cfg = _compose(overrides, machine=False)  # no model runs: torch stays unimported (seconds)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.data import ensure_prepared, prepare
    from suite.data.checks import check_prepare
    from suite.data.prepare import claim_prepared

    check_prepare(cfg)

    if not cfg.data.path:
        out = ensure_prepared(cfg.data, progress=True, summary=True)
    elif claim_prepared(cfg.data, Path(cfg.data.path), OVERWRITE in flags):
        out = Path(cfg.data.path).expanduser()
        print(f"{out} already holds this data (the same sources, files and settings); nothing to do")
    else:  # a new folder, or --overwrite: the older prepared data there is moved aside whole
        out = prepare(cfg.data, Path(cfg.data.path).expanduser(), progress=True, summary=True)
    meta = json.loads((out / "meta.json").read_text())
    return _report(
        flags,
        {"path": str(out), **meta},
        f"prepared {out}: vocab {meta['vocab_size']}, {meta['num_train_tokens']:,} train tokens, "
        f"{meta['num_val_tokens']:,} validation tokens",
    )


HELP = """usage: suite prepare [data=OPTION] [data.path=OUT] ['data.sources=[{path: GLOB_OR_DATASET, weight: W}]']

Trains a byte-level BPE tokenizer (data.vocab_size) and writes packed, memory-mapped token shards
(train/val split by data.val_fraction) into data.path. Sources are local .txt/.jsonl/.jsonl.gz/.parquet
files, folders or globs, folders `datasets` wrote (save_to_disk), or `datasets` names, blended by
weight. With no sources: the embedded corpus (no network).

Keys: data.path  data.sources  data.vocab_size  data.val_fraction  data.tokenizer  data.cache_dir
Run again into the same data.path: nothing to do when its sources (their files' sizes and times) and
settings are the same; refused when they differ, unless --overwrite (the older data is moved aside to
<data.path>.old-N, never deleted).
A prepared folder trains with data.path=<it>, model.vocab_size at least its vocabulary and
data.seq_len at most the model's max_seq_len (gpt-tiny: 256).

Examples:
  suite prepare
  suite prepare 'data.sources=[{path: "corpus/*.jsonl"}]' data.path=data/prepared data.vocab_size=8192
  suite pretrain data.path=data/prepared run.dir=runs/prepared-8k"""


VERB = register(
    Verb(
        name="prepare",
        summary="build a tokenizer and packed token shards from text",
        help=HELP,
        run=run,
        unused=(
            "ckpt",
            "generate",
            "export",
            "prune",
            "finetune",
            "distill",
            "eval",
            "optim",
            "sched",
            "recompute",
            "cluster",
            "compress",
            "parallel",
            "launch",
            "align",
        ),
        flags=(OVERWRITE,),
        section="tools",
        stage_output="files",
        output_key="data.path",
    )
)
