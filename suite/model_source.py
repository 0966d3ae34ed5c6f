"""One model source: what `ckpt=`, `model.init_from=` or `hf:<dir>` names, parsed once.

    suite run folder     runs/gpt-tiny                  its newest checkpoint that verifies
    checkpoint folder    runs/gpt-tiny/checkpoints/step_20
    Hugging Face folder  hf:path/to/save_pretrained/folder
    llama.cpp GGUF file  gguf:path/to/model.gguf       dequantized on load (suite.gguf_file)

`ModelSource.parse(text, key)` is the only place that reads that syntax (the key names the config
key in one-line errors). A source gives the model config (the run's saved config.yaml, or the
HF config.json mapped by suite.models.hf_mapping), the tokenizer, its weights as suite-named lazy tensors
(export streams them), and loading into a model of any layout: sharded or tensor-parallel
(collective; each rank reads its own shard), fused projections, LoRA adapters (kept as they are).

Layering: above models, data, parallel and train.checkpoint; below finetune, export, infer and
the CLI, which all take their model through here. The trainer does not import it: the verb hands
the trainer a loader (`initial_weights`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from suite.config.compose import load_saved_config
from suite.config.errors import ConfigError
from suite.config.schema import LoRAConfig, ModelConfig, SuiteConfig
from suite.data import load_tokenizer
from suite.gguf_file import GGUF_PREFIX, GGUFFile
from suite.models import build_model, materialize
from suite.models.hf_mapping import from_hf_state_dict, model_config_from_hf
from suite.models.lazy import Box, InMemory, LazyTensor, Source, as_lazy
from suite.models.lora import apply_lora, merge_lora
from suite.models.qat import LEARNED_SCALE
from suite.models.quantized import is_quantized, load_quantized_base
from suite.parallel.data_parallel import canonical_name
from suite.train.checkpoint import checkpoint_step, find_checkpoint, load_model_weights

HF_PREFIX = "hf:"
# parameters a training verb adds beside the model's own (suite distill's hidden-state projections;
# compress=qat-*'s learned scales, which only the conversion to int4/int8 reads; multi-token prediction
# modules, suite.models.mtp): saved in its checkpoints for resume, never part of the model a run's
# weights are read as
TRAINING_ONLY = ("distill_proj.", "mtp.")
TRAINING_ONLY_PARTS = (".weight_fake_quantizer.",)


def training_only(key: str) -> bool:
    """A parameter name (suite names) that is no part of the model a run's weights are read as."""
    return key.startswith(TRAINING_ONLY) or any(part in key for part in TRAINING_ONLY_PARTS)


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model source: `folder` is the checkpoint folder (suite), the HF folder, or the
    GGUF file. `is_hf`: the weights come under HF names from outside the suite (an HF folder or a
    GGUF file, `gguf` set): no saved run config, no steps."""

    text: str  # as the user wrote it
    key: str  # the config key it came from: ckpt, model.init_from
    folder: Path
    is_hf: bool
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over because they did not verify
    gguf: bool = False

    @classmethod
    def parse(cls, value: str | Path | ModelSource, key: str = "ckpt") -> ModelSource:
        """Resolve `value` once: an HF folder must hold config.json; a suite path must be a run
        folder with a checkpoint that verifies, or a checkpoint folder."""
        if isinstance(value, ModelSource):
            return value
        text = str(value)
        if text.startswith(HF_PREFIX):
            folder = Path(text[len(HF_PREFIX) :]).expanduser()
            if not (folder / "config.json").is_file():
                raise ConfigError(
                    f"{key}='{text}' has no config.json; give hf:<a folder written by save_pretrained>"
                )
            return cls(text, key, folder, True)
        if text.startswith(GGUF_PREFIX):
            path = Path(text[len(GGUF_PREFIX) :]).expanduser()
            if not path.is_file():
                raise ConfigError(f"{key}='{text}': no such file; give gguf:<a .gguf file>")
            return cls(text, key, path, True, gguf=True)
        try:
            folder, skipped = find_checkpoint(text)
        except ConfigError as exc:
            hint = f"; a GGUF file is read as {key}=gguf:{text}" if text.endswith(".gguf") else ""
            raise ConfigError(f"{key}='{text}': {exc}{hint}") from None
        return cls(text, key, folder, False, tuple(skipped))

    def describe(self) -> str:
        """One line naming what is read: `ckpt='runs/x': step 8 (runs/x/checkpoints/step_8, verified)`,
        after the checkpoints that were skipped because they did not verify."""
        if self.gguf:
            return f"{self.named}: {self.gguf_file.describe()}"
        if self.is_hf:
            return f"{self.named}: Hugging Face folder {self.folder}"
        skipped = "".join(f"; {note}" for note in self.skipped)
        return f"{self.named}: step {checkpoint_step(self.folder)} ({self.folder}, verified{skipped})"

    @property
    def named(self) -> str:
        """How errors name the source: `ckpt='runs/x'`."""
        return f"{self.key}='{self.text}'"

    @property
    def run_dir(self) -> Path | None:
        """The suite run folder the checkpoint belongs to (None for an HF folder)."""
        return None if self.is_hf else self.folder.parent.parent

    @cached_property
    def gguf_file(self) -> GGUFFile:
        """The parsed GGUF file (a gguf: source only)."""
        return GGUFFile(self.folder, self.named)

    @cached_property
    def saved(self) -> SuiteConfig | None:
        """The resolved config of the run that wrote a suite checkpoint (None for an HF folder)."""
        if self.is_hf:
            return None
        return load_saved_config(self.folder / "config.yaml")

    @property
    def lora(self) -> LoRAConfig | None:
        """The LoRA settings when the checkpoint holds base weights + adapters, else None."""
        saved = self.saved
        return saved.finetune.lora if saved is not None and saved.finetune.method == "lora" else None

    @property
    def quantized(self) -> bool:
        """A `suite quantize` checkpoint (torchao tensors in safetensors, not a DCP checkpoint)."""
        return not self.is_hf and is_quantized(self.folder)

    def learned_scales(self) -> dict[str, torch.Tensor]:
        """A compress=qat-* run's trained quantization scales by Linear name (compress.learn_scales;
        suite.models.qat), which its conversion stores; empty for any other source."""
        if self.is_hf or self.quantized:
            return {}
        found = checkpoint_tensors(self.folder, lambda key: key.endswith(LEARNED_SCALE))
        return {key.removesuffix(LEARNED_SCALE): tensor.read() for key, tensor in found.items()}

    @cached_property
    def quantized_base(self) -> ModelSource | None:
        """For a LoRA run trained over a quantized checkpoint (QLoRA): that checkpoint, else None."""
        saved = self.saved
        init_from = saved.model.init_from if saved is not None else None
        if self.lora is None or not init_from or str(init_from).startswith(HF_PREFIX):
            return None
        try:
            base = ModelSource.parse(init_from, "model.init_from")
        except ConfigError:  # moved or deleted: a plain LoRA checkpoint holds its base weights itself
            return None
        return base if base.quantized else None

    def model_config(self) -> ModelConfig:
        """The architecture: the saved run's model config, or the HF config.json mapped to suite's."""
        if self.gguf:
            return self.gguf_file.config
        if self.is_hf:
            return model_config_from_hf(self.folder, self.named)
        return self.saved.model

    def tokenizer(self, required: bool = True) -> Any:
        """The run's tokenizer (with the chat template it trained with), or the HF folder's; None
        when an HF folder has none and `required` is False; a GGUF file's from its metadata."""
        if self.gguf:
            return self.gguf_file.tokenizer()
        if self.is_hf:
            if not (
                (self.folder / "tokenizer.json").is_file()
                or (self.folder / "tokenizer_config.json").is_file()
            ):
                if not required:
                    return None
                raise ConfigError(
                    f"{self.named} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                    "give a save_pretrained folder that includes its tokenizer"
                )
            # deferred: transformers costs seconds to import; only a Hugging Face source's tokenizer needs it
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.folder, trust_remote_code=False)
        if not (self.run_dir / "tokenizer.json").is_file():
            raise ConfigError(
                f"{self.named}: the run folder {self.run_dir} has no tokenizer.json (training copies it there "
                "from its data folder); copy the data folder's tokenizer.json into the run folder, or give "
                "a run folder that has one"
            )
        return load_tokenizer(self.run_dir)

    @contextlib.contextmanager
    def weights(self) -> Iterator[dict[str, LazyTensor]]:
        """The model's tensors under suite names, unread (LoRA adapters folded in): export reads
        them one at a time."""
        if self.is_hf:
            cfg = self.model_config()
            with self._hf_tensors(cfg) as tensors:
                yield from_hf_state_dict(cfg, tensors)
            return
        lora = self.lora
        yield checkpoint_weights(self.folder, lora.alpha / lora.rank if lora is not None else None)

    @torch.no_grad()
    def load_weights(self, model: nn.Module, fused_projections: bool = False) -> None:
        """Copy the source's weights into `model` (any layout; collective when distributed).

        LoRA adapter parameters (in no base) keep their values. A suite checkpoint is read with DCP
        (resharded to this layout); from an HF folder each rank reads only its own shard of every
        tensor (safetensors slices through the lazy HF -> suite mapping). `fused_projections`: the
        model fuses q/k/v and gate/up (model.fused_projections; an HF folder never does).
        """
        if self.is_hf:
            cfg = dataclasses.replace(self.model_config(), fused_projections=fused_projections)
            with self._hf_tensors(cfg) as tensors:
                load_suite_weights(model, from_hf_state_dict(cfg, tensors), self.named)
            return
        if self.quantized:  # QLoRA: the frozen quantized base under the adapters
            load_quantized_base(model, self.folder)
            return
        state = {  # adapters and training-only modules (distill_proj) are no part of any source
            k: v for k, v in get_model_state_dict(model).items() if ".lora_" not in k and not training_only(k)
        }
        dcp.load({"model": state}, checkpoint_id=str(self.folder))
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))

    @contextlib.contextmanager
    def _hf_tensors(self, cfg: ModelConfig) -> Iterator[dict[str, LazyTensor]]:
        """An imported source's tensors under HF names, unread (an HF folder's or a GGUF file's)."""
        if self.gguf:
            yield self.gguf_file.hf_weights(cfg)
            return
        with hf_weights(self.folder, self.named) as tensors:
            yield tensors

    def load_model(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
        """A single-device model in eval mode holding the source's weights (LoRA adapters merged)."""
        # an imported source overwrites every parameter (load_suite_weights refuses a missing one): no init
        model = materialize(build_model(self.model_config()), device, seed=None if self.is_hf else 0)
        if dtype != torch.float32:
            model.to(dtype)
        lora = self.lora
        if self.is_hf:
            self.load_weights(model)
        elif lora is not None:  # the checkpoint holds base + adapters: fold them in
            apply_lora(model, lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))
            base = self.quantized_base
            if base is not None:  # QLoRA: the quantized base stays quantized, the adapters beside it
                base.load_weights(model)
            load_model_weights(self.folder, model)
            if base is None:
                merge_lora(model)
        else:
            load_model_weights(self.folder, model)
        return model.eval()


def initial_weights(cfg: SuiteConfig) -> Callable[[nn.Module], None] | None:
    """What the trainer calls to replace its seeded initialisation: model.init_from's weights
    loaded into the parallelized model, or None when model.init_from is unset."""
    if not cfg.model.init_from:
        return None
    source = ModelSource.parse(cfg.model.init_from, "model.init_from")
    fused = cfg.model.fused_projections
    return lambda model: source.load_weights(model, fused)


# ---- reading HF folders and suite checkpoints lazily ------------------------------------------------
def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@contextlib.contextmanager
def hf_weights(folder: Path, where: str | None = None) -> Iterator[dict[str, LazyTensor]]:
    """The tensors of a save_pretrained folder, unread: safetensors are sliced on read; a .bin
    checkpoint is memory-mapped (weights-only)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    with contextlib.ExitStack() as stack:
        tensors: dict[str, LazyTensor] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = handle.get_slice(name)
                tensors[name] = Source(
                    piece.get_shape(),
                    SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32),
                    lambda box, piece=piece: piece[_slices(box)] if box else piece[:],
                )
        if not files:
            for path in sorted(Path(folder).glob("pytorch_model*.bin")):
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    state = torch.load(path, map_location="cpu", weights_only=True)
                tensors.update({k: InMemory(v) for k, v in state.items()})
        if not tensors:
            raise ConfigError(f"{where or folder}: no *.safetensors or pytorch_model*.bin weights found")
        yield tensors


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained folder in memory (tests compare the lazy path with it)."""
    with hf_weights(folder) as tensors:
        return {name: tensor.read() for name, tensor in tensors.items()}


def checkpoint_weights(folder: Path, lora_scaling: float | None = None) -> dict[str, LazyTensor]:
    """A suite checkpoint's model tensors (plain names), each read from the DCP files on demand.

    With `lora_scaling` (a LoRA run), `X.weight` reads as X.weight + (lora_b @ lora_a) * scaling and
    the adapter tensors themselves are left out, as `merge_lora` does in memory.
    """
    raw = checkpoint_tensors(folder, lambda key: not training_only(key))
    if lora_scaling is None:
        return raw
    out = {k: v for k, v in raw.items() if ".lora_a." not in k and ".lora_b." not in k}
    for name in list(out):
        prefix = name.removesuffix(".weight")
        a, b = raw.get(prefix + ".lora_a.weight"), raw.get(prefix + ".lora_b.weight")
        if a is not None and b is not None:
            out[name] = _Merged(out[name], a, b, lora_scaling)
            continue
        # stacked expert weights (`experts.w1`): per-expert factors `experts.lora_a.w1` [E, r, in]
        head, _, leaf = name.rpartition(".")
        a, b = raw.get(f"{head}.lora_a.{leaf}"), raw.get(f"{head}.lora_b.{leaf}")
        if a is not None and b is not None:
            out[name] = _MergedExperts(out[name], a, b, lora_scaling)
    return out


def checkpoint_tensors(folder: Path, keep: Callable[[str], bool]) -> dict[str, LazyTensor]:
    """The model tensors of a suite checkpoint whose plain names `keep` accepts, read on demand."""
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata

    def stored(key: str, info: TensorStorageMetadata) -> Source:
        def read(box: Box) -> torch.Tensor:
            value = torch.empty(info.size, dtype=info.properties.dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({key: value}, storage_reader=FileSystemReader(str(folder)), no_dist=True)
            return value[_slices(box)]

        return Source(info.size, info.properties.dtype, read)

    return {
        key.removeprefix("model."): stored(key, info)
        for key, info in metadata.items()
        if key.startswith("model.")
        and isinstance(info, TensorStorageMetadata)
        and keep(key.removeprefix("model."))
    }


class _Merged(LazyTensor):
    """W + (B @ A) * scaling, computed in fp32 and returned in W's dtype (as merge_lora does)."""

    def __init__(self, weight: LazyTensor, a: LazyTensor, b: LazyTensor, scaling: float):
        self.weight, self.a, self.b, self.scaling = weight, a, b, scaling
        self.shape, self.dtype = weight.shape, weight.dtype

    def _read(self, box: Box) -> torch.Tensor:
        (r0, r1), (c0, c1) = box
        b = self.b.read(((r0, r1), (0, self.b.shape[1]))).float()
        a = self.a.read(((0, self.a.shape[0]), (c0, c1))).float()
        return (self.weight.read(box).float() + (b @ a) * self.scaling).to(self.dtype)


class _MergedExperts(_Merged):
    """W[e] + (B[e] @ A[e]) * scaling for stacked expert weights [E, out, in] (as merge_lora does)."""

    def _read(self, box: Box) -> torch.Tensor:
        (e0, e1), (r0, r1), (c0, c1) = box
        b = self.b.read(((e0, e1), (r0, r1), (0, self.b.shape[2]))).float()
        a = self.a.read(((e0, e1), (0, self.a.shape[1]), (c0, c1))).float()
        return (self.weight.read(box).float() + torch.bmm(b, a) * self.scaling).to(self.dtype)


# ---- loading: each rank reads its own shard -----------------------------------------------------------
def local_box(param: torch.Tensor) -> Box:
    """The part of the full tensor that this rank holds: a box of global indices."""
    if not isinstance(param, DTensor):
        return tuple((0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(
            f"the local shard {tuple(param.to_local().shape)} of a {tuple(param.shape)} parameter is not "
            f"one box of the full tensor (placements {param.placements})"
        )
    return tuple((o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_suite_weights(
    model: nn.Module, weights: Mapping[str, LazyTensor | torch.Tensor], where: str
) -> None:
    """Copy `weights` (suite names) into `model`, reading only each rank's shard of each tensor.

    Parameters missing from `weights` are an error, except LoRA adapters (not in any base) and
    training-only parameters (`training_only`).
    """
    missing = []
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if ".lora_a." in key or ".lora_b." in key or training_only(key):
            continue
        if key not in weights:
            missing.append(key)
            continue
        source = as_lazy(weights[key])
        if tuple(source.shape) != tuple(param.shape):
            raise ConfigError(
                f"{where}: {key} has shape {tuple(source.shape)}, the model {tuple(param.shape)}"
            )
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(source.read(local_box(param)).to(target.dtype))
    for name, buffer in persistent_buffers(model):  # state that is no parameter (DeepSeek's expert bias)
        key = canonical_name(name)
        if key not in weights:
            missing.append(key)
            continue
        buffer.copy_(as_lazy(weights[key]).read().to(buffer.dtype))  # whole on every rank
    if missing:
        raise ConfigError(f"{where}: weights do not match the config (missing {missing[:3]})")


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers a state dict holds (not RoPE tables and other derived ones)."""
    return [
        (f"{prefix}.{name}" if prefix else name, buffer)
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]


def load_hf_weights(model: nn.Module, folder: Path, fused_projections: bool = False) -> None:
    """An HF folder's weights into a suite model of any layout (each rank reads its own shards)."""
    ModelSource.parse(f"{HF_PREFIX}{folder}").load_weights(model, fused_projections)


def load_hf_model(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Any]:
    """A suite Transformer holding an HF folder's weights, read tensor by tensor, and the folder's
    tokenizer (None when it has none)."""
    source = ModelSource.parse(f"{HF_PREFIX}{folder}")
    return source.load_model(device, dtype), source.tokenizer(required=False)
