"""HF import and export one tensor at a time, for models larger than one rank's memory.

import   `load_hf_weights(model, folder)`: every rank of a sharded or tensor-parallel run reads
         only its own shard of each parameter from the safetensors files (slice reads through
         the lazy HF -> suite mapping; suite.export.lazy), never the full model.
export   `checkpoint_weights(folder)`: a suite DCP checkpoint (any layout wrote it) as lazy
         tensors, read one tensor at a time in one process (LoRA adapters folded in on read);
         `write_hf_folder` converts them to HF names and writes safetensors shards of at most
         `max_shard_bytes`, holding one shard in memory.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.export.lazy import Box, InMemory, LazyTensor, Source, as_lazy

MAX_SHARD_BYTES = 2 * 1024**3
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


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


# ---- reading -------------------------------------------------------------------------------------
@contextlib.contextmanager
def hf_weights(folder: Path) -> Iterator[dict[str, LazyTensor]]:
    """The tensors of a save_pretrained folder, unread: safetensors are sliced on read; a .bin
    checkpoint is memory-mapped (weights-only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
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
            for path in sorted(folder.glob("pytorch_model*.bin")):
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    state = torch.load(path, map_location="cpu", weights_only=True)
                tensors.update({k: InMemory(v) for k, v in state.items()})
        if not tensors:
            raise ConfigError(f"hf:{folder}: no *.safetensors or pytorch_model*.bin weights found")
        yield tensors


def checkpoint_weights(folder: Path, lora_scaling: float | None = None) -> dict[str, LazyTensor]:
    """A suite checkpoint's model tensors (plain names), each read from the DCP files on demand.

    With `lora_scaling` (a LoRA run), `X.weight` reads as X.weight + (lora_b @ lora_a) * scaling and
    the adapter tensors themselves are left out, as `merge_lora` does in memory.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata

    def stored(key: str, info: TensorStorageMetadata) -> Source:
        def read(box: Box) -> torch.Tensor:
            import torch.distributed.checkpoint as dcp

            value = torch.empty(info.size, dtype=info.properties.dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({key: value}, storage_reader=FileSystemReader(str(folder)), no_dist=True)
            return value[_slices(box)]

        return Source(info.size, info.properties.dtype, read)

    raw = {
        key.removeprefix("model."): stored(key, info)
        for key, info in metadata.items()
        if key.startswith("model.") and isinstance(info, TensorStorageMetadata)
    }
    if lora_scaling is None:
        return raw
    out = {k: v for k, v in raw.items() if ".lora_a." not in k and ".lora_b." not in k}
    for name in list(out):
        prefix = name.removesuffix(".weight")
        a, b = raw.get(prefix + ".lora_a.weight"), raw.get(prefix + ".lora_b.weight")
        if a is not None and b is not None:
            out[name] = _Merged(out[name], a, b, lora_scaling)
    return out


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


# ---- import: each rank reads its own shard ------------------------------------------------------------
def local_box(param: torch.Tensor) -> Box:
    """The part of the full tensor that this rank holds: a box of global indices."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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

    Parameters missing from `weights` are an error, except LoRA adapters (not in any base).
    """
    from torch.distributed.tensor import DTensor

    from suite.parallel.data_parallel import canonical_name

    missing = []
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if ".lora_a." in key or ".lora_b." in key:
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
    if missing:
        raise ConfigError(f"{where}: weights do not match the config (missing {missing[:3]})")


def load_hf_weights(model: nn.Module, folder: Path, fused_projections: bool = False) -> None:
    """An HF folder's weights into a suite model of any layout (each rank reads its own shards);
    `fused_projections`: the model fuses q/k/v and gate/up (model.fused_projections)."""
    import dataclasses

    from suite.export.hf import from_hf_state_dict, model_config_from_hf

    cfg = dataclasses.replace(model_config_from_hf(folder), fused_projections=fused_projections)
    with hf_weights(folder) as tensors:
        load_suite_weights(model, from_hf_state_dict(cfg, tensors), f"hf:{folder}")


# ---- export: one shard in memory at a time -----------------------------------------------------------
def on_disk_names(cfg: ModelConfig, hf_sd: dict) -> dict:
    """The names transformers' save_pretrained writes: Mixtral experts one by one
    (block_sparse_moe.experts.N.w1/w2/w3), as older transformers and other tools read them."""
    if not cfg.num_experts:
        return hf_sd
    out = {}
    for name, value in hf_sd.items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.")
            for e in range(value.shape[0]):
                w1, w3 = value.select(0, e).chunk(2, dim=0)
                out[f"{prefix}{e}.w1.weight"], out[f"{prefix}{e}.w3.weight"] = w1, w3
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts.")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.w2.weight"] = value.select(0, e)
        elif ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value
        else:
            out[name] = value
    return out


def write_hf_weights(
    hf_sd: Mapping[str, LazyTensor | torch.Tensor],
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json when
    the weights exceed `max_shard_bytes`; reads each tensor when its shard is written."""
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    size = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, value in hf_sd.items():
        nbytes = value.numel() * itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(groups, 1):
        file = out / (
            "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        shard = {n: as_lazy(hf_sd[n]).read().to(dtype).contiguous() for n in names}
        save_file(shard, str(file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(names, file.name))
        files.append(file)
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files
