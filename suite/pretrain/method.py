"""Pretraining, composed: `TokenData` (the prepared token shards, built on first use) and
`InitialWeights` (model.init_from's weights in place of the seeded initialisation). Distillation on
pretraining data (distill.data=pretrain) composes the same two with its teacher."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data import TokenBatches, ensure_prepared, load_tokenizer
from suite.data.prepare import verify_prepared
from suite.model_source import ModelSource, initial_weights
from suite.train.components import Component, Data, Method, Trainer

# chat_template.jinja: the template of a tokenizer reused from an instruct model (data.tokenizer), which
# the run, and so its exports and the models made from it (prune, distill), keep
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class TokenData(Data):
    """The recipe's data.* corpus as fixed windows (suite.data.loader), checked against the model."""

    def prepare(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.data_dir = ensure_prepared(cfg.data, progress=trainer.env.is_main)
        verify_prepared(self.data_dir)  # sizes + sha256 of shards and tokenizer: one-line error if corrupt
        self.meta = json.loads((self.data_dir / "meta.json").read_text())
        if cfg.model.init_from:
            check_init_tokenizer(cfg.model.init_from, self.data_dir)
        if self.meta["vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.meta['vocab_size']} tokens in {self.data_dir}; set model.vocab_size>={self.meta['vocab_size']}"
            )

    def loaders(self, trainer: Trainer) -> tuple[Any, Any]:
        cfg, dims, device = trainer.cfg, trainer.dims, trainer.device
        prefetch = (device.type != "cpu") if cfg.data.prefetch is None else cfg.data.prefetch
        # data.doc_mask: documents end with EOS (suite.data.documents); the batches carry their positions
        eos_id = int(self.meta["eos_id"]) if cfg.data.doc_mask else None
        p, dp_rank, dp = cfg.parallel, trainer.placement.dp_rank, dims.data_parallel_size
        train = TokenBatches(
            self.data_dir, "train", cfg.data.seq_len, p.micro_batch_size, p.global_batch_size, dp_rank, dp,
            cfg.train.seed, prefetch=prefetch, pin_memory=device.type == "cuda", eos_id=eos_id,
        )  # fmt: skip
        held_out = TokenBatches(
            self.data_dir, "val", cfg.data.seq_len, p.micro_batch_size, p.micro_batch_size * dp, dp_rank, dp,
            cfg.train.seed, eos_id=eos_id,
        )  # fmt: skip
        return train, held_out

    def write_run_files(self, trainer: Trainer) -> None:
        for name in TOKENIZER_FILES:  # the tokenizer beside config.yaml
            if (self.data_dir / name).is_file():
                shutil.copyfile(self.data_dir / name, trainer.run_dir / name)

    def vocab(self) -> dict:
        return load_tokenizer(self.data_dir).get_vocab()


def check_init_tokenizer(init_from: str, data_dir: Path) -> None:
    """Training from model.init_from reads the data's token ids with the weights' embedding: data
    prepared with another tokenizer than the model's own would train every id as another token, and
    nothing would fail. Refused in one line naming the tokenizer to prepare with."""
    source = ModelSource.parse(init_from, "model.init_from")
    try:
        own = source.tokenizer(required=False)
    except ConfigError:  # a run folder without its tokenizer: nothing to compare with
        return
    data_vocab = load_tokenizer(data_dir).get_vocab()
    if own is None or own.get_vocab() == data_vocab:
        return
    if source.gguf:
        way = (
            f"export it first (suite export ckpt={source.text} format=hf out=<folder>) and pass "
            "data.tokenizer=<that folder>"
        )
    else:
        way = f"pass data.tokenizer={source.folder if source.is_hf else source.run_dir}"
    raise ConfigError(
        f"{source.named} has its own tokenizer ({len(own.get_vocab())} tokens) and the data in {data_dir} "
        f"was prepared with another ({len(data_vocab)} tokens), so its weights would read other token ids; "
        f"prepare the text with the model's tokenizer: {way} with data.sources (or none: the embedded "
        "corpus) and no data.path"
    )


class InitialWeights(Component):
    """model.init_from's weights loaded into the placed model (`load`: suite.model_source.initial_weights,
    None when model.init_from is unset)."""

    def __init__(self, load: Callable[[torch.nn.Module], None] | None):
        self.load = load

    def load_weights(self, trainer: Trainer) -> None:
        if self.load is not None:
            self.load(trainer.model)


def compose(cfg: SuiteConfig) -> Method:
    """`suite pretrain`: token shards, from scratch or from model.init_from."""
    return Method("pretrain", TokenData(), [InitialWeights(initial_weights(cfg))])
