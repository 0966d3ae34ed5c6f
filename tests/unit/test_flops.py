"""MFU: the matmul FLOPs per token against a hand count, and the measured ceiling it is divided by."""

from __future__ import annotations

import torch

from suite.config.schema import ModelConfig
from suite.models.transformer import flops_per_token
from suite.train import peak_flops


def test_recorded_ceiling_keeps_the_best_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    assert peak_flops.record_peak("cpu-x", 5e10) == 5e10
    assert peak_flops.record_peak("cpu-x", 2e10) == 5e10  # a busy machine never lowers the ceiling
    assert peak_flops.record_peak("cpu-x", 8e10) == 8e10


def test_peak_flops_prefers_override_then_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    assert peak_flops.peak_flops(cpu, "fp32", override=1.5e9) == 1.5e9
    peak_flops.record_peak(peak_flops.peak_key(cpu, "fp32"), 7e10)
    assert peak_flops.peak_flops(cpu, "fp32") == 7e10


def test_a_cached_ceiling_a_step_outruns_is_measured_again_and_raised(tmp_path, monkeypatch):
    """A ceiling cached from a busy machine is too low forever (the cache only raises entries); the
    first step that outruns it triggers one new measurement, and the MFU stays at most 1."""
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    key = peak_flops.peak_key(cpu, "fp32")
    peak_flops.record_peak(key, 1e9)  # measured under load
    measured = []
    monkeypatch.setattr(
        peak_flops, "measure_matmul_peak", lambda device, precision: measured.append(1) or 4e9
    )
    ceiling = peak_flops.Ceiling(cpu, "fp32")
    assert ceiling.mfu(tokens_per_s=100.0, flops_per_token=5e6, world_size=1) == 0.5  # 5e8 of 1e9
    assert measured == []
    assert ceiling.mfu(tokens_per_s=1000.0, flops_per_token=5e6, world_size=2) == 2.5e9 / 4e9
    assert measured == [1] and peak_flops.peak_flops(cpu, "fp32") == 4e9  # measured again, cached
    assert ceiling.mfu(tokens_per_s=2000.0, flops_per_token=5e6, world_size=1) == 1.0  # not measured again
    assert measured == [1] and peak_flops.peak_flops(cpu, "fp32") == 10e9
    outrun = peak_flops.Ceiling(cpu, "fp32")  # the new measurement is still below the step: the step's rate
    monkeypatch.setattr(peak_flops, "measure_matmul_peak", lambda device, precision: 3e9)
    assert outrun.mfu(tokens_per_s=4000.0, flops_per_token=5e6, world_size=1) == 1.0
    assert peak_flops.peak_flops(cpu, "fp32") == 20e9
    given = peak_flops.Ceiling(cpu, "fp32", override=1e9)  # a peak the user gives is theirs
    assert given.mfu(tokens_per_s=2000.0, flops_per_token=5e6, world_size=1) == 10.0


def test_no_mfu_peak_where_the_cpu_emulates_the_precision(tmp_path, monkeypatch, capsys):
    """An emulated fp16/bf16 ceiling does not apply (MFU came out above 1 against it): none, said once."""
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path))
    monkeypatch.setattr(peak_flops, "emulates_low_precision", lambda device, precision: precision != "fp32")
    cpu = torch.device("cpu")
    assert peak_flops.peak_flops(cpu, "fp16") is None
    assert "MFU is not reported" in capsys.readouterr().err
    assert peak_flops.peak_flops(cpu, "fp16", override=2e9) == 2e9  # a peak the user gives applies
    peak_flops.record_peak(peak_flops.peak_key(cpu, "fp32"), 7e10)
    assert peak_flops.peak_flops(cpu, "fp32") == 7e10


def test_matmul_ceiling_is_measured():
    assert peak_flops.measure_matmul_peak(torch.device("cpu"), "fp32", sizes=(128,), seconds=0.05) > 0


def test_matmul_ceiling_skips_sizes_that_would_outlast_the_budget(monkeypatch):
    """Emulated bf16 runs ~1 GFLOP/s: the probe's rate tells which sizes to skip (here: all of them)."""
    sizes_built = []
    real_randn = torch.randn
    monkeypatch.setattr(
        torch, "randn", lambda *shape, **kw: sizes_built.append(shape[0]) or real_randn(*shape, **kw)
    )
    assert peak_flops.measure_matmul_peak(torch.device("cpu"), "fp32", sizes=(8192,), seconds=1e-6) > 0
    assert sizes_built == [peak_flops.PROBE_SIZE]  # the 8192 product (1.1 TFLOP) was never started


# MFU's numerator, counted by hand: multiply-adds (MACs) per token of the forward, for every matmul.
# Training = 2 FLOPs per MAC x (1 forward + 2 backward) = 6 x MACs. Embedding lookups, norms, biases
# and activations are not matmuls; causal attention sees seq / 2 keys per query on average.


def test_flops_per_token_matches_a_hand_count_gpt_tied_and_untied():
    # 2 layers, width 64, 4 heads of 16, GELU MLP 256 (4 x 64), vocab 512, seq 32
    seq = 32
    q = k = v = o = 64 * 64
    mlp = 64 * 256 + 256 * 64
    scores = values = 4 * 16 * (seq // 2)  # 4 heads x head_dim 16 x 16 keys on average
    layer = q + k + v + o + mlp + scores + values  # 16384 + 32768 + 2048 = 51200
    head = 64 * 512
    macs = 2 * layer + head  # 135168; the token table (512 x 64) and the position table are lookups
    assert macs == 135_168
    for tied in (True, False):
        cfg = ModelConfig(
            family="gpt",
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            vocab_size=512,
            max_seq_len=32,
            tie_embeddings=tied,
        )
        assert flops_per_token(cfg, seq) == 6 * macs  # untying adds a lookup, not a matmul


def test_flops_per_token_matches_a_hand_count_llama_gqa_swiglu():
    # 2 layers, width 64, 4 query heads of 16, 2 kv heads (GQA), SwiGLU 96, vocab 100, untied, seq 40
    seq = 40
    q, k, v, o = 64 * 64, 64 * 32, 64 * 32, 64 * 64  # k and v: 2 kv heads x 16
    mlp = 64 * 96 + 64 * 96 + 96 * 64  # gate, up, down
    scores = values = 4 * 16 * (seq // 2)  # every query head attends: 4 x 16 x 20 keys on average
    layer = q + k + v + o + mlp + scores + values  # 12288 + 18432 + 2560 = 33280
    head = 64 * 100
    macs = 2 * layer + head
    assert macs == 72_960
    cfg = ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        vocab_size=100,
        max_seq_len=64,
        tie_embeddings=False,
    )
    assert flops_per_token(cfg, seq) == 6 * macs


def test_flops_per_token_counts_the_router_and_only_the_routed_experts():
    # the llama model above with layer 1 MoE: 8 experts of width 48, top-2, one shared expert
    seq = 40
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 2 * 4 * 16 * (seq // 2)
    dense = 3 * 64 * 96
    router = 64 * 8
    moe = router + 2 * (3 * 64 * 48) + 1 * (3 * 64 * 48)  # two routed experts + the shared one
    macs = 2 * attention + dense + moe + 64 * 100
    cfg = ModelConfig(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        vocab_size=100,
        max_seq_len=64,
        tie_embeddings=False,
        num_experts=8,
        top_k=2,
        moe_every=2,
        num_shared_experts=1,
        moe_ffn_hidden_size=48,
    )
    assert flops_per_token(cfg, seq) == 6 * macs


def _on_gpu(monkeypatch, name: str) -> torch.device:
    """peak_flops as on a CUDA device called `name` (torch.cuda.get_device_name monkeypatched)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


def test_data_sheet_peaks_by_device_name(monkeypatch):
    cases = {
        ("NVIDIA H100 80GB HBM3", "bf16"): 989e12,
        ("NVIDIA H100 PCIe", "bf16"): 756e12,
        ("NVIDIA H100 NVL", "bf16"): 835e12,
        ("NVIDIA H200", "bf16"): 989e12,
        ("NVIDIA A100-SXM4-40GB", "bf16"): 312e12,
        ("NVIDIA A100 80GB PCIe", "bf16"): 312e12,
        ("NVIDIA A10G", "bf16"): 70e12,
        ("NVIDIA A10", "bf16"): 125e12,
        ("NVIDIA L4", "bf16"): 121e12,
        ("NVIDIA L40S", "bf16"): 362e12,
        ("Tesla V100-SXM2-16GB", "fp16"): 125e12,
        ("AMD Instinct MI300X", "bf16"): 1307.4e12,
        ("NVIDIA H100 80GB HBM3", "fp32"): 67e12,
    }
    for (name, precision), peak in cases.items():
        assert peak_flops.peak_flops(_on_gpu(monkeypatch, name), precision) == peak, (name, precision)
    assert peak_flops.tabled_peak("NVIDIA H100 NVL", "fp8") == 1671e12
    # an fp8 run's MFU is against the bf16 peak, comparable with a bf16 run's
    assert peak_flops.peak_flops(_on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3"), "fp8") == 989e12


def test_an_unknown_gpu_reports_no_mfu_unless_given_a_peak(monkeypatch, capsys):
    """A device the table lacks (or a precision it lacks) gets no peak, so no MFU rather than a wrong one."""
    device = _on_gpu(monkeypatch, "NVIDIA Future GPU 9000")
    assert peak_flops.peak_flops(device, "bf16") is None
    err = capsys.readouterr().err
    assert "MFU is not reported" in err and "NVIDIA Future GPU 9000" in err and "train.peak_flops" in err
    assert peak_flops.peak_flops(device, "bf16", override=5e14) == 5e14
    assert (
        peak_flops.peak_flops(_on_gpu(monkeypatch, "Tesla V100-SXM2-32GB"), "bf16") is None
    )  # no bf16 cores


def test_memory_metrics_add_the_cuda_allocator_peaks_on_cuda_only(monkeypatch):
    assert set(peak_flops.memory_metrics(torch.device("cpu"))) == {"mem_gb"}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
    stats = peak_flops.memory_metrics(torch.device("cuda", 0))
    assert stats == {"mem_gb": 3.0, "mem_allocated_gb": 3.0, "mem_reserved_gb": 4.0}
