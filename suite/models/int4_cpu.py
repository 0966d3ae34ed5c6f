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

Large inputs (prefill, the quantize report's perplexity pass: more than `DEQUANT_ROWS` rows) take
another path. The packed kernel suits batch-1 decode; at 2,048 rows it was ~2x slower than fp32's
matmul (1536 x 576 weight: 117 ms against 64 ms, docs/benchmarks.md), while unpacking the weight costs
a few passes over its N x K values whatever the rows. So above the threshold the weight is
dequantized, once per call, from the packed bytes to the activation dtype and a plain F.linear runs;
that weight equals torchao's dequantized one exactly (no bf16 rounding of activations or output on
this path). Nothing extra is kept in memory: the dequantized weight lives for the call only (the
point of int4 is its ~0.56 byte a weight; a cached fp32 copy would add 4). Unpacking reads the
kernel's own layout (`kernel_layout`, found once per process by packing a probe); where no known
layout matches, every call takes the kernel.

Only the modules of a loaded model are replaced (`pack_for_cpu`); the stored file is unchanged.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the packed int4 kernel takes
# rows of a call above which the int4 weight is dequantized for a plain matmul (module docstring): on
# SmolLM2's four weight shapes the kernel was faster at 64 rows and slower at 128 (1 thread, bench/
# int4_decode.py --crossover, docs/benchmarks.md)
DEQUANT_ROWS = 64

# The packed kernel's byte layout, as torch's weight_to_int4pack_kernel writes it
# (aten/src/ATen/native/cpu/int4mm_kernel.cpp): output rows in blocks of `block` (64 on AVX-512, 32 on
# AVX2 and the scalar build), each block [K, rows in it / 2] bytes, one after another. In a full block
# a byte holds rows r (low nibble) and r + block/2 (high) on AVX-512/AVX2 ("halves"); a partial last
# block, and every block of the scalar build, holds rows n and n + 1 ("pairs").
LAYOUTS = ((64, "halves"), (32, "halves"), (32, "pairs"))


def _pairs(chunk: torch.Tensor) -> torch.Tensor:
    """[..., K, n/2] bytes holding rows 2i (low nibble) and 2i+1 (high) -> [..., n, K]."""
    q = torch.stack([chunk & 15, chunk >> 4], dim=-1)
    return q.reshape(*chunk.shape[:-1], -1).transpose(-1, -2)


def unpack_int4(packed: torch.Tensor, rows: int, cols: int, layout: tuple[int, str]) -> torch.Tensor:
    """The [rows, cols] values 0..15 that `_convert_weight_to_int4pack_for_cpu` packed in `layout`."""
    block, kind = layout
    flat = packed.reshape(-1)
    full = rows // block * block
    body = flat[: full * cols // 2].view(full // block, cols, block // 2)
    if kind == "halves":
        parts = [torch.cat([body & 15, body >> 4], dim=-1).transpose(1, 2).reshape(full, cols)]
    else:
        parts = [_pairs(body).reshape(full, cols)]
    if rows > full:
        parts.append(_pairs(flat[full * cols // 2 :].view(cols, (rows - full) // 2)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@cache
def kernel_layout() -> tuple[int, str] | None:
    """The layout this process's kernel packs in (one of LAYOUTS), found by packing a probe of 112
    rows (a full block and a partial one in each); None when none matches (a torch that packs
    otherwise: then large inputs take the kernel too)."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (112, 64), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in LAYOUTS:
        if torch.equal(unpack_int4(packed, 112, 64, layout).to(torch.int32), probe):
            return layout
    return None


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
        self.layout = kernel_layout()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`, unpacked from the packed bytes: (q - 8 - z) * scale per group,
        the integer zero point z recovered from the kernel's bf16 zero = -z * scale (|z| <= 8, so
        bf16 rounding moves -zero / scale by at most 8 * 2^-9 = 1/64: rounding recovers z exactly)."""
        n, k, g = self.out_features, self.in_features, self.group
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [N, K / group, 2]
        scale, zero = sz[..., 0], sz[..., 1]
        z = torch.where(scale == 0, 0.0, torch.round(-zero / torch.where(scale == 0, 1.0, scale)))
        q = unpack_int4(self.packed, n, k, self.layout).view(n, k // g, g).float()
        return ((q - (8.0 + z).unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > DEQUANT_ROWS and self.layout is not None:  # prefill: see the module docstring
            y = F.linear(flat, self.dequantized(x.dtype))
        else:
            flat = flat.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group, self.scales_and_zeros
            )
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
