"""generate.dtype: the eager decoder in bf16/fp16 (half the bytes read per token) decodes the same
sequence as fp32 with logits within a stated tolerance, leaves the caller's model alone, keeps the
stored weight layout (torch's half CPU kernels read it fastest), and refuses models it cannot cast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, SuiteConfig
from suite.config.validate import check_values
from suite.infer.checks import check_generate
from suite.infer.decoder import BatchDecoder
from suite.models import build_model, materialize
from suite.models.lora import apply_lora

CFG = ModelConfig(
    family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_seq_len=48
)
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 99]]
# max |logits - fp32 logits| on this model (logits of std 0.2): measured 5.7e-4 (fp16, 11 mantissa
# bits) and 4.1e-3 (bf16, 8); the tolerance is 4x that
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _model() -> nn.Module:
    return materialize(build_model(CFG), "cpu", seed=3).eval()


def _logits_along(decoder: BatchDecoder, prompts: list[list[int]], tokens: torch.Tensor | None) -> tuple:
    """(logits of every step, greedy tokens); `tokens` given: those are fed back instead (teacher
    forcing), so two precisions are compared on the same sequence."""
    seen = []

    def pick(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        step = len(seen) - 1
        return logits.argmax(-1, keepdim=True) if tokens is None else tokens[:, step : step + 1]

    out = torch.stack(list(decoder.generate(prompts, 8, pick)), 1)
    return torch.stack(seen, 1), out


@pytest.fixture(scope="module")
def fp32_run():
    model = _model()
    return model, _logits_along(BatchDecoder(model), PROMPTS, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_decode_is_fp32_within_tolerance(dtype, fp32_run):
    model, (want, tokens) = fp32_run
    before = {n: p.clone() for n, p in model.named_parameters()}
    half = BatchDecoder(model, dtype=dtype)
    assert {p.dtype for p in half.model.parameters()} == {dtype} and half.head is None
    # RoPE's frequencies stay fp32 (rounded to half, a position-4000 angle is off by ~0.5 rad)
    assert torch.equal(half.model.rope_inv_freq, model.rope_inv_freq)
    for linear in (m for m in half.model.layers.modules() if type(m) is nn.Linear):
        assert linear.weight.is_contiguous()  # the stored [out, in] form, not fp32's transpose
    got, _ = _logits_along(half, PROMPTS, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype])
    for name, p in model.named_parameters():  # the caller's model: still fp32, unchanged
        assert p.dtype == torch.float32 and torch.equal(p, before[name])


def test_fp32_is_the_default_and_the_model_as_given():
    model = _model()
    assert BatchDecoder(model).head is not None and SuiteConfig().generate.dtype == "fp32"
    assert next(BatchDecoder(model, dtype=torch.float32).model.parameters()).dtype == torch.float32


def test_bad_dtype_and_uncastable_models_are_refused_in_one_line():
    cfg = SuiteConfig()
    cfg.generate.dtype = "fp8"
    with pytest.raises(
        ConfigError, match=r"generate.dtype='fp8' is not supported; use one of: fp32, bf16, fp16"
    ):
        check_values(cfg)
    with pytest.raises(ConfigError, match=r"generate.dtype='fp8' is not supported"):
        check_generate(cfg)  # what `suite generate` / `suite chat` run, before the model is read
    lora = _model()
    apply_lora(lora, 4, 8.0, 0.0, ("wq", "wv"))
    with pytest.raises(
        ConfigError, match=r"generate.dtype=fp16: only plain dense models .* generate.dtype=fp32"
    ):
        BatchDecoder(lora, dtype=torch.float16)
