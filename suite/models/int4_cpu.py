"""The CPU runtime layout of int4 (and int8 per-row) weights: what a loaded quantized model computes with.

A `suite quantize` checkpoint stores int4 weights as torchao's IntxUnpackedToInt8Tensor (one int8 per
4-bit value, bf16 scales per group; suite.models.quantized). Its matmul dequantizes the whole weight to
fp32 on every call: on SmolLM2-135M that made int4 decode ~6x slower than fp32 (docs/benchmarks.md).
Decoding at batch 1 reads every weight once per token, so what bounds it is bytes of weights, and the
packed int4 kernel torch ships for the CPU reads ~0.56 byte a weight where fp32 reads 4:

    torch.ops.aten._convert_weight_to_int4pack_for_cpu(q [N, K] int32 in 0..15, 1)      (packs)
    torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, packed, group, sz [K/g, N, 2] bf16)
        = x @ W.T with W = (q - 8) * scale + zero per group

torchao's stored value v in [-8, 7] with zero point z is W = (v - z) * scale, so q = v + 8 and
zero = -z * scale (0 on a symmetric grid; compress=gptq's default asymmetric grid has integer z). The kernel takes bf16
activations (fp32 ones go through a path ~10x slower), so x is rounded to bf16 going in and the
output widened back: logits then differ from the dequantized fp32 reference by bf16 rounding of the
activations and of the kernel's bf16 output (tests/unit/test_int4_cpu.py bounds it).

The compress.embedding=int8 tied head (an IntxUnpackedToInt8Tensor with one scale per row) uses
`torch.ops.aten._weight_int8pack_mm(x bf16, w int8 [N, K], scales [N] bf16)` the same way. Int8
Linear weights of compress=int8, gptq-int8 and compress.int8_layers are torchao's Int8Tensor, which
`packable_int8_rows` does not take: they keep torchao's own matmul.

Only the modules of a loaded model are replaced (`pack_for_cpu`); the stored file is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the packed int4 kernel takes


def _torchao_intx(weight: Any) -> bool:
    return type(weight).__name__ == "IntxUnpackedToInt8Tensor" and weight.activation_quantization is None


def packable(weight: Any) -> bool:
    """An int4 weight-only torchao tensor, group-wise with a group the kernel takes."""
    if not _torchao_intx(weight) or weight.target_dtype != torch.int4 or weight.dim() != 2:
        return False
    rows, group = weight.block_size
    return rows == 1 and group in KERNEL_GROUPS and weight.shape[1] % group == 0


def packable_int8_rows(weight: Any) -> bool:
    """An int8 weight-only tensor with one scale per output row and no zero point."""
    if _torchao_intx(weight):
        ok = weight.target_dtype == torch.int8 and tuple(weight.block_size) == (1, weight.shape[1])
        return ok and weight.dim() == 2 and not weight.zero_point.any()
    return False


class PackedInt4Linear(nn.Module):
    """A Linear whose int4 weight is in the CPU kernel's packed layout (weights ~0.56 byte each)."""

    def __init__(self, weight: Any, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features, self.group = in_features, out_features, weight.block_size[1]
        q = weight.qdata.to(torch.int32) + 8  # [-8, 7] -> [0, 15]
        scale = weight.scale.float().reshape(out_features, -1)
        zero = -weight.zero_point.float().reshape(out_features, -1) * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz)  # [K / group, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group={self.group}"


class PackedInt8Linear(nn.Module):
    """A Linear whose int8 per-row weight runs through the CPU int8 kernel with bf16 activations."""

    def __init__(self, weight: Any, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.qdata.to(torch.int8).contiguous())
        self.register_buffer("scales", weight.scale.reshape(-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def pack_for_cpu(model: nn.Module) -> list[str]:
    """Replace, in place, each Linear of `model` holding a torchao int4 (or int8 per-row) weight-only
    tensor with its packed CPU module; returns their names. For a model that only runs forwards
    (eval, generate, the quantize report): its state dict no longer holds torchao's tensors."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if packable(module.weight):
            _replace(model, name, PackedInt4Linear(module.weight, module.bias))
        elif packable_int8_rows(module.weight):
            _replace(model, name, PackedInt8Linear(module.weight, module.bias))
        else:
            continue
        replaced.append(name)
    return replaced


def reference_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized fp32 matmul a torchao weight computes (what the packed modules approximate)."""
    return F.linear(x, weight.dequantize().float(), bias)
