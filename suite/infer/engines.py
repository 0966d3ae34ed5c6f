"""What `suite generate` / `suite chat` decode with, from any artifact ckpt= names: a suite run or
checkpoint, an HF folder, a `suite quantize` checkpoint (all: the suite model, suite.infer.decoder),
or a `suite export format=torch_export|onnx` folder (its prefill/decode graphs, suite.infer.runners).

An engine yields each step's next tokens for a batch of prompts; suite.infer.generate turns them
into text (stop sequences, eos, streaming)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.infer.decoder import BatchDecoder
from suite.infer.generate import load_for_inference
from suite.infer.runners import graph_steps, is_graph_export, load_runner
from suite.model_source import ModelSource
from suite.runtime import DTYPES

Pick = Callable[[torch.Tensor], torch.Tensor]


class ModelEngine:
    """The suite model with the static-cache batch decoder: prompts of any lengths in one batch."""

    pads = True

    def __init__(
        self,
        model: torch.nn.Module,
        compile: bool = False,
        owns_model: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        """owns_model: the engine is the model's only user: eager CPU decoding relays it in place
        (suite.infer.decode_layout), after which it is for inference only (not to be trained or saved).
        dtype: the decode precision (generate.dtype; a copy of `model` in it unless owns_model)."""
        self.decoder = BatchDecoder(model, compile=compile, owns_model=owns_model, dtype=dtype)
        self.max_seq_len = model.cfg.max_seq_len

    def steps(self, prompts: list[list[int]], max_new_tokens: int, pick: Pick) -> Iterator[torch.Tensor]:
        return self.decoder.generate(prompts, max_new_tokens, pick)


class GraphEngine:
    """An exported prefill/decode pair: one batch holds prompts of one length (no padding input)."""

    pads = False

    def __init__(self, folder: Path, threads: int | None = None):
        self.runner, self.manifest = load_runner(folder, threads)
        self.max_seq_len = self.runner.max_seq_len

    def steps(self, prompts: list[list[int]], max_new_tokens: int, pick: Pick) -> Iterator[torch.Tensor]:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("GraphEngine.steps: group prompts by length first")
        return graph_steps(self.runner, torch.tensor(prompts), max_new_tokens, pick)


def load_engine(
    ckpt: str, device: str = "cpu", compile: bool = False, dtype: str = "fp32"
) -> tuple[Any, Any, str]:
    """(engine, tokenizer, one line naming what was read) for ckpt= as typed; dtype: generate.dtype
    (the suite model's decode precision; an export decodes in its own)."""
    folder = Path(str(ckpt)).expanduser()
    if is_graph_export(folder):
        if dtype != "fp32":
            raise ConfigError(
                f"generate.dtype={dtype}: ckpt='{ckpt}' is a graph export, which decodes in the precision "
                "it was exported in; use generate.dtype=fp32 with it, or a suite run or model source"
            )
        # deferred: transformers costs seconds to import; only an ONNX/graph export's tokenizer needs it
        from transformers import AutoTokenizer

        engine = GraphEngine(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        fmt, precision = engine.manifest["format"], engine.manifest["precision"]
        return (
            engine,
            tokenizer,
            f"ckpt='{ckpt}': {fmt} export ({precision}) of {engine.manifest['source']['ckpt']}",
        )
    source = ModelSource.parse(ckpt, "ckpt")
    model, tokenizer, _ = load_for_inference(source, device)
    engine = ModelEngine(model, compile=compile, owns_model=True, dtype=DTYPES[dtype])
    return engine, tokenizer, source.describe() + ("" if dtype == "fp32" else f", decoding in {dtype}")
