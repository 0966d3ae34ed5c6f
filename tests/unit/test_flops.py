"""The MFU denominator: a measured CPU ceiling only ever rises, a recipe value always wins."""

from __future__ import annotations

import torch

from suite.config.schema import ModelConfig
from suite.models.transformer import flops_per_token, num_params
from suite.train import flops


def test_recorded_ceiling_keeps_the_best_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    assert flops.record_peak("cpu-x", 5e10) == 5e10
    assert flops.record_peak("cpu-x", 2e10) == 5e10  # a busy machine never lowers the ceiling
    assert flops.record_peak("cpu-x", 8e10) == 8e10


def test_peak_flops_prefers_override_then_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    assert flops.peak_flops(cpu, "fp32", override=1.5e9) == 1.5e9
    flops.record_peak(flops.peak_key(cpu, "fp32"), 7e10)
    assert flops.peak_flops(cpu, "fp32") == 7e10


def test_matmul_ceiling_is_measured():
    assert flops.measure_matmul_peak(torch.device("cpu"), "fp32", sizes=(128,), seconds=0.05) > 0


def test_matmul_ceiling_skips_sizes_that_would_outlast_the_budget(monkeypatch):
    """Emulated bf16 runs ~1 GFLOP/s: the probe's rate tells which sizes to skip (here: all of them)."""
    sizes_built = []
    real_randn = torch.randn
    monkeypatch.setattr(
        torch, "randn", lambda *shape, **kw: sizes_built.append(shape[0]) or real_randn(*shape, **kw)
    )
    assert flops.measure_matmul_peak(torch.device("cpu"), "fp32", sizes=(8192,), seconds=1e-6) > 0
    assert sizes_built == [flops.PROBE_SIZE]  # the 8192 product (1.1 TFLOP) was never started


def test_flops_per_token_counts_six_n_plus_attention():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=32)
    assert flops_per_token(cfg, 32) == 6 * num_params(cfg) + 12 * 2 * 32 * 64
