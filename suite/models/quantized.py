"""Quantized checkpoints: torchao tensor subclasses in one safetensors file, and back.

A checkpoint folder written by `suite quantize` holds, besides config.yaml and manifest.json:

    model.safetensors   the model's state dict, torchao's tensor subclasses flattened by
                        torchao.prototype.safetensors (each subclass's inner tensors + a JSON
                        description in the file's metadata); plain tensors as they are
    quantized.json      {"method", "torchao", "quantized": [module names], "skipped": [...]}

The weights carry everything needed to compute with them (the int8 dynamic-activation setting of
w8a8 is an attribute of the tensor), so loading does not re-run quantization: build the model,
then assign the saved tensors in place of its parameters. A tied output head is not stored twice.

int4 weights (torchao's IntxUnpackedToInt8Tensor, one int8 per 4-bit value in memory) are stored
two values to a byte, and an all-zero zero point (symmetric quantization) is not stored; both are
restored on load, so the round trip is exact and the file holds ~4.5 bits per block weight.

The blocks' float tensors left unquantized (norm weights, biases) are rounded to bf16 values by
`suite quantize` before it measures the model (narrow_block_floats) and stored as bf16, as a bf16
checkpoint stores them; listed in the file's metadata, they are widened back to fp32 on load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "quantized.json"
_PACKED = "_int4packed"  # suffix of a packed qdata entry
_ZERO = "_zero_point"
_NARROWED = "suite_bf16_as_fp32"  # metadata: JSON list of fp32 tensors stored as (exact) bf16


# torchao's import logs, to the user's terminal, a warning per prebuilt kernel library it cannot
# load here (torchao/__init__.py: "Failed to load <...>.so: ..."), and torch's pytree one per enum
# torchao registers ("<enum> is an Enum subclass and is now natively supported by torch.compile ...":
# deprecated, harmless). transformers imports torchao on its own (its torchao quantizer), so every
# hf/gguf export and HF load printed the four lines before any of the suite's imports below ran.
TORCHAO_IMPORT_NOISE = {
    "torchao": "Failed to load ",  # the message starts so; the .so named after it
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.compile",
}


def _not_torchao_import_noise(record: logging.LogRecord) -> bool:
    start = TORCHAO_IMPORT_NOISE[record.name]
    message = str(record.msg)
    return not (message.startswith(start) and (record.name != "torchao" or ".so" in message))


def silence_torchao_import() -> None:
    """Drop exactly those records (logging filters on the two loggers, installed once, before
    anything imports torchao: at this module's import); other warnings of either logger still show."""
    for name in TORCHAO_IMPORT_NOISE:
        logger = logging.getLogger(name)
        if _not_torchao_import_noise not in logger.filters:
            logger.addFilter(_not_torchao_import_noise)


silence_torchao_import()


def quiet_torchao() -> None:
    """torchao logs a warning per optional CUDA extension it cannot load on this machine, and its
    import registers enums that torch's pytree warns about (deprecated, harmless)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def is_quantized(folder: str | Path) -> bool:
    return (Path(folder) / INFO_FILE).is_file()


def quantized_info(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / INFO_FILE).read_text())


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], pairs along the last dimension -> one uint8 each (low nibble first)."""
    return ((q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)).to(torch.uint8)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.int8)
    return torch.stack([(p << 4) >> 4, p >> 4], dim=-1).flatten(-2)  # arithmetic shifts: sign kept


def _is_int4(tensor: Any) -> bool:
    return type(tensor).__name__ == "IntxUnpackedToInt8Tensor" and tensor.target_dtype == torch.int4


@torch.no_grad()
def narrow_block_floats(model: nn.Module) -> list[str]:
    """Round the blocks' unquantized fp32 parameters to bf16 values in place (they stay fp32 tensors);
    returns their names. Stored as bf16, they then round-trip exactly."""
    names = []
    for name, param in model.named_parameters():
        if name.startswith("layers.") and param.dtype == torch.float32 and not is_quantized_tensor(param):
            param.copy_(param.to(torch.bfloat16))
            names.append(name)
    return names


def save_quantized(model: nn.Module, folder: str | Path, info: dict[str, Any]) -> Path:
    """Write model.safetensors and quantized.json into `folder`; returns the weights file."""
    quiet_torchao()
    # deferred: safetensors/torchao load only when a quantized checkpoint is written or read
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    state = model.state_dict()
    if getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings:
        state.pop("output.weight", None)  # the embedding's tensor (restored by tie_weights)
    data, metadata = flatten_tensor_state_dict(state)
    for name, tensor in state.items():
        if not _is_int4(tensor) or tensor.qdata.shape[-1] % 2:
            continue
        module, attr = name.rsplit(".", 1)
        qkey, zkey = f"{module}._{attr}_qdata", f"{module}._{attr}{_ZERO}"
        data[qkey + _PACKED] = _pack_int4(data.pop(qkey))
        if zkey in data and not data[zkey].any():
            del data[zkey]
    narrowed = []
    for name, tensor in data.items():
        exact = tensor.dtype == torch.float32 and torch.equal(tensor, tensor.to(torch.bfloat16).float())
        if name.startswith("layers.") and exact:
            narrowed.append(name)
    for name in narrowed:
        data[name] = data[name].to(torch.bfloat16)
    metadata = {**(metadata or {}), _NARROWED: json.dumps(narrowed)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHTS_FILE
    save_file({k: v.detach().cpu().contiguous() for k, v in data.items()}, str(path), metadata=metadata)
    (folder / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return path


def read_quantized_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The saved state dict with torchao's tensor subclasses rebuilt (int4 unpacked)."""
    quiet_torchao()
    # deferred: safetensors/torchao load only when a quantized checkpoint is written or read
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    path = Path(folder) / WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    data = load_file(str(path))
    metadata = dict(metadata or {})
    for name in json.loads(metadata.pop(_NARROWED, "[]")):
        data[name] = data[name].float()
    for key in [k for k in data if k.endswith(_PACKED)]:
        qdata = _unpack_int4(data.pop(key))
        qkey = key.removesuffix(_PACKED)
        data[qkey] = qdata
        zkey = qkey.removesuffix("_qdata") + _ZERO
        scale = data.get(qkey.removesuffix("_qdata") + "_scale")
        if zkey not in data and scale is not None:
            data[zkey] = torch.zeros(scale.shape, dtype=torch.int8)
    state, leftover = unflatten_tensor_state_dict(data, metadata)
    if leftover:
        raise ValueError(f"{path}: tensors not described by its metadata: {sorted(leftover)[:3]}")
    return state


def load_quantized_model(folder: str | Path, model_cfg, device: str | torch.device = "cpu") -> nn.Module:
    """A single-device eval model holding the quantized weights of a `suite quantize` checkpoint."""
    # deferred: suite.models imports this module (the quantized checkpoint format sits below it)
    from suite.models import build_model, materialize

    model = materialize(build_model(model_cfg), "cpu", seed=None).requires_grad_(
        False
    )  # every tensor assigned below
    state = read_quantized_state(folder)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (k == "output.weight" and model_cfg.tie_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder}: the quantized weights do not match the config "
            f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    model.tie_weights()
    return model.to(device).eval()


@torch.no_grad()
def load_quantized_base(model: nn.Module, folder: str | Path) -> int:
    """QLoRA: a `suite quantize` checkpoint's weights in a training model wrapped with LoRA adapters.

    The quantized weights replace their parameters as non-persistent buffers: frozen, outside the
    optimizer, and outside every state dict, so DCP checkpoints of the run hold only the adapters
    and the float tensors (torchao's int4 tensors do not go through DCP); they are read again from
    model.init_from on resume and by `suite eval/generate`. Every other tensor is copied into its
    parameter. Returns the number of weights attached quantized. Single device (a plain model).
    """
    # deferred: suite.models imports this module (the quantized checkpoint format sits below it)
    from suite.models.lora import canonical

    state = read_quantized_state(folder)
    modules = {canonical(name): module for name, module in model.named_modules()}
    params = {canonical(name): param for name, param in model.named_parameters()}
    attached = 0
    for name, tensor in state.items():
        owner, _, attr = name.rpartition(".")
        if is_quantized_tensor(tensor):
            module = modules[owner]
            device = getattr(module, attr).device
            delattr(module, attr)
            module.register_buffer(attr, tensor.to(device), persistent=False)
            attached += 1
        elif name in params:
            params[name].copy_(tensor.to(params[name].dtype))
        else:
            raise ValueError(f"{folder}: {name} is in the quantized checkpoint but not in the model")
    loaded = set(state)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    missing = [
        n for n in params if n not in loaded and ".lora_" not in n and not (tied and n == "output.weight")
    ]
    if missing:
        raise ValueError(f"{folder}: the quantized checkpoint lacks {missing[:3]}")
    return attached


def is_quantized_tensor(tensor: Any) -> bool:
    """A torchao quantized tensor (any of its subclasses), not a plain tensor or parameter."""
    # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
    from torchao.utils import TorchAOBaseTensor

    data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    return isinstance(data, TorchAOBaseTensor) or isinstance(tensor, TorchAOBaseTensor)
