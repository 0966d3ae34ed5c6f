"""The packed CPU layout of int4 / int8-row weights (suite.models.int4_cpu) against torchao's
dequantized reference.

Tolerances: the kernels take bf16 activations and return bf16, so one matmul with inputs already on
bf16 values differs from the fp32 dequantized product by the bf16 rounding of its output (2^-9 of
each value) plus fp32 accumulation order: 1/128 of the largest output covers it. A layout error (the
+8 offset, a zero's sign, a transposed scale) moves outputs by whole scales, ~10-100x more.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _quantized_linear(out_f: int, in_f: int, group: int, asymmetric: bool, bias: bool) -> nn.Linear:
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, PerGroup, quantize_

    torch.manual_seed(0)
    linear = nn.Linear(in_f, out_f, bias=bias)
    if asymmetric:  # a weight whose groups are off-centre, so the zero points are not 0
        linear.weight.data += 0.05
    mapping = MappingType.ASYMMETRIC if asymmetric else MappingType.SYMMETRIC
    config = IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerGroup(group), mapping_type=mapping, scale_dtype=torch.bfloat16
    )
    quantize_(linear, config)
    return linear


@pytest.mark.parametrize(("group", "asymmetric", "bias"), [(32, False, False), (64, True, True)])
def test_packed_int4_linear_equals_the_dequantized_matmul(group, asymmetric, bias):
    from suite.models.int4_cpu import PackedInt4Linear, packable, reference_linear

    linear = _quantized_linear(96, 128, group, asymmetric, bias)
    assert packable(linear.weight)
    if asymmetric:
        assert linear.weight.zero_point.any()
    packed = PackedInt4Linear(linear.weight, linear.bias)
    x = torch.randn(2, 5, 128).bfloat16().float()  # on bf16 values: only the output's rounding differs
    with torch.no_grad():
        ref = reference_linear(x, linear.weight, linear.bias)
    got = packed(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float((got - ref).abs().max()) < float(ref.abs().max()) / 128


def test_packed_int8_rows_equal_the_dequantized_matmul():
    from torchao.quantization import IntxWeightOnlyConfig, PerAxis, quantize_

    from suite.models.int4_cpu import PackedInt8Linear, packable_int8_rows, reference_linear

    torch.manual_seed(0)
    linear = nn.Linear(64, 200, bias=False)
    quantize_(linear, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)))
    assert packable_int8_rows(linear.weight)
    x = torch.randn(3, 64).bfloat16().float()
    ref = reference_linear(x, linear.weight)
    got = PackedInt8Linear(linear.weight, None)(x)
    assert float((got - ref).abs().max()) < float(ref.abs().max()) / 128


def test_pack_for_cpu_keeps_a_quantized_model_s_logits():
    """A tiny llama quantized by compress=int4 with the int8 embedding/head: every int4 Linear and the
    tied int8 head packed; logits within 2% (relative L2) of the torchao model's. Through two blocks
    each Linear's input is rounded to bf16 (2^-9 relative), which measured 0.3-0.5% here."""
    from suite.compress.methods import quantize_model
    from suite.config.schema import CompressConfig, ModelConfig
    from suite.models import build_model, materialize
    from suite.models.int4_cpu import PackedInt4Linear, PackedInt8Linear, pack_for_cpu

    cfg = ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=256,
        max_seq_len=32,
    )
    model = materialize(build_model(cfg), "cpu", seed=0).eval().requires_grad_(False)
    targets, _ = quantize_model(model, CompressConfig(method="int4", embedding="int8"), torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens)
        names = pack_for_cpu(model)
        got = model(tokens)
    modules = dict(model.named_modules())
    assert sorted(names) == sorted([*targets, "output"])
    assert all(isinstance(modules[n], PackedInt4Linear) for n in targets)
    assert isinstance(modules["output"], PackedInt8Linear)
    error = float((got - ref).norm() / ref.norm())
    assert error < 0.02, error


def test_large_inputs_dequantize_exactly_and_small_ones_take_the_kernel():
    """Above DEQUANT_ROWS rows a call unpacks the weight from the kernel's own bytes and runs an fp32
    F.linear; at DEQUANT_ROWS it takes the kernel. 112 output rows: a full 64-row block and a partial
    one in AVX-512's layout (three 32-row blocks and a 16-row one in AVX2's), asymmetric grid.

    Unpacked, the weight equals torchao's dequantized one bit for bit; the large call's output is the
    fp32 reference's up to summation order (1e-5 of the largest value, where the kernel's bf16 output
    is ~1e-3 off); the small call's output is the kernel's, every value a bf16 value."""
    from suite.models.int4_cpu import DEQUANT_ROWS, PackedInt4Linear, kernel_layout, reference_linear

    linear = _quantized_linear(112, 128, 32, True, False)
    assert linear.weight.zero_point.any()
    packed = PackedInt4Linear(linear.weight, None)
    assert kernel_layout() is not None and packed.layout == kernel_layout()  # this torch's layout is known
    assert torch.equal(packed.dequantized(torch.float32), linear.weight.dequantize().float())
    x = torch.randn(DEQUANT_ROWS + 1, 128, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    with torch.no_grad():
        ref = reference_linear(x, linear.weight)
        large, small = packed(x), packed(x[:DEQUANT_ROWS])
    top = float(ref.abs().max())
    assert float((large - ref).abs().max()) < 1e-5 * top
    assert torch.equal(small, small.bfloat16().float())  # the kernel ran: its output is bf16
    assert float((small - ref[:DEQUANT_ROWS]).abs().max()) < top / 128
