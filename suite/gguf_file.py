"""A llama.cpp GGUF file as a model source (`gguf:<file>`): architecture, weights and tokenizer.

The file is the export of suite.export.gguf read backwards, so a file the suite writes and one
llama.cpp's converter writes (e.g. SmolLM2's Q4_1) read the same way:

    architecture  general.architecture -> the family whose `Family.gguf.arch` it is; the
                  hyper-parameters through transformers' own GGUF config reader (no hand-kept
                  key table), mapped like any HF config (`Family.hf.from_config`), plus what that
                  reader misses (`GGUFMapping.config_kwargs`)
    weights       each tensor memory-mapped and dequantized when read (the `gguf` package: any
                  llama.cpp type it reads, Q4_0 ... Q8_0, K-quants), named by inverting gguf's
                  HF -> GGUF name map, the family's layout undone (Llama's interleaved q/k rows
                  back to rotate-half, GPT-2's Conv1D weights transposed); a tied head is the
                  embedding, as a file without `output.weight` means
    tokenizer     transformers' GGUF tokenizer (the token list, merges, special ids and
                  `tokenizer.chat_template` from the metadata)

What cannot be read is refused in one line (ConfigError): not a GGUF file or a damaged one, an
architecture no family maps, a model the family's GGUF mapping cannot express.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.data.gguf_metadata import GGUFMetadata
from suite.models.family import FAMILIES, Family, kv_heads
from suite.models.hf_mapping import to_hf_state_dict
from suite.models.lazy import Box, LazyTensor, Source
from suite.models.transformer import build_model

GGUF_PREFIX = "gguf:"


class GGUFFile(GGUFMetadata):
    """A GGUF file as a model source: the family, config and weights its metadata and tensors give."""

    @cached_property
    def family(self) -> Family:
        for family in FAMILIES.values():
            if family.gguf is not None and self.arch in family.gguf.archs():
                problem = family.gguf.import_problem(self.arch)
                if problem:
                    raise ConfigError(
                        f"{self.where} is a '{self.arch}' GGUF, which cannot be imported: {problem}"
                    )
                return family
        known = sorted(
            a
            for f in FAMILIES.values()
            if f.gguf is not None
            for a in f.gguf.archs()
            if not f.gguf.import_problem(a)
        )
        raise ConfigError(
            f"{self.where} is a '{self.arch}' GGUF; importable GGUF architectures: {', '.join(known)}"
        )

    @cached_property
    def config(self) -> ModelConfig:
        """The architecture through transformers' GGUF config reader and the family's HF mapping."""
        family = self.family
        # deferred: transformers costs seconds to import; only a GGUF source's config needs it
        from transformers import AutoConfig

        extra = family.gguf.config_kwargs(self.arch_fields())
        try:
            with self.transformers_reading():
                hf = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name, **extra)
        except (ValueError, KeyError, OSError) as exc:
            raise ConfigError(f"{self.where}: its metadata does not describe a model ({exc})") from None
        name = self.path.stem
        cfg = ModelConfig(name=name, family=family.name, **family.hf.from_config(hf, self.where))
        problem = family.gguf.problem(cfg)
        if problem:
            raise ConfigError(f"{self.where} cannot be imported: {problem}")
        return cfg

    def describe(self) -> str:
        types = sorted({t.tensor_type.name for t in self.reader.tensors})
        return f"GGUF file {self.path} ({self.arch}, {'/'.join(types)}, dequantized on load)"

    def hf_weights(self, cfg: ModelConfig) -> dict[str, LazyTensor]:
        """The file's tensors under HF names and in HF's layout, dequantized (fp32) when read."""
        # deferred: gguf is optional (the deploy extra); only a GGUF source needs it
        import gguf

        mapping = self.family.gguf
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[mapping.arch.upper()], cfg.num_layers)
        unfused = dataclasses.replace(cfg, fused_projections=False)
        hf_names = to_hf_state_dict(unfused, build_model(unfused).state_dict())
        by_gguf = {}
        for hf_name in hf_names:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is not None:
                by_gguf[name] = hf_name
        out: dict[str, LazyTensor] = {}
        for tensor in self.reader.tensors:
            hf_name = by_gguf.get(tensor.name)
            if hf_name is None:
                continue  # e.g. rope_freqs: derived, not a weight
            heads = None
            if mapping.permute_qk and hf_name.endswith("self_attn.q_proj.weight"):
                heads = cfg.num_heads
            elif mapping.permute_qk and hf_name.endswith("self_attn.k_proj.weight"):
                heads = kv_heads(cfg)
            transpose = bool(mapping.transposed) and hf_name.endswith(mapping.transposed)
            out[hf_name] = _stored(tensor, heads, transpose, self.where)
        return out


def _stored(tensor: Any, heads: int | None, transpose: bool, where: str) -> Source:
    """One GGUF tensor as a lazy HF-layout tensor: dequantized whole on read, then boxed."""
    shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists dims innermost first
    if transpose:
        shape = shape[::-1]

    def read(box: Box) -> torch.Tensor:
        # deferred: gguf is optional (the deploy extra); only a GGUF source needs it
        from gguf import dequantize

        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # noqa: BLE001 (a damaged tensor is a damaged file, said in one line)
            raise ConfigError(f"{where}: tensor {tensor.name} cannot be read ({exc})") from None
        value = torch.from_numpy(array.copy()).float().reshape(shape[::-1] if transpose else shape)
        if heads is not None:  # llama.cpp's interleaved rotary pairs -> HF's rotate-half rows
            rows = value.shape[0]
            value = value.reshape(heads, rows // heads // 2, 2, *value.shape[1:]).swapaxes(1, 2)
            value = value.reshape(rows, *value.shape[3:])
        if transpose:
            value = value.t().contiguous()
        return value[tuple(slice(a, b) for a, b in box)] if box else value

    return Source(shape, torch.float32, read)
