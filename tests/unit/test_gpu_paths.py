"""The GPU code paths that this CPU can check in part: fp8 (torchao float8 training) refused off
float8 hardware and its Linear swap on the meta model; the CUDA runs themselves are skipped here
(they need a GPU, said in the skip) and run where one is present."""

from __future__ import annotations

import pytest
import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig, TrainConfig
from suite.models import build_model
from suite.models.float8 import prepare_float8
from suite.runtime import check_fp8, resolve_precision

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64)
NEEDS_FP8_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with float8 tensor cores (compute capability 8.9+)",
)


def test_fp8_precision_is_bf16_autocast_plus_float8_linears():
    policy = resolve_precision(TrainConfig(precision="fp8"))
    assert (
        policy.float8 and policy.compute_dtype == torch.bfloat16 and policy.autocast_dtype == torch.bfloat16
    )
    assert not resolve_precision(TrainConfig(precision="bf16")).float8


def test_fp8_is_refused_in_one_line_without_float8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"^train.precision=fp8 needs .* no CUDA device; use train.precision=bf16$"
    ):
        check_fp8("auto")
    with pytest.raises(ConfigError, match="train.device=cpu"):
        check_fp8("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="NVIDIA A100-SXM4-80GB is 8.0"):
        check_fp8("auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8("auto")  # Hopper: accepted


def test_float8_swaps_the_block_linears_but_not_the_head():
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(TINY, "meta")
    names = prepare_float8(model, resolve_precision(TrainConfig(precision="fp8")))
    swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(names) and swapped
    assert "output" not in swapped and all(n.startswith("layers.") for n in swapped), swapped
    before = {n for n, _ in build_model(TINY, "meta").named_parameters()}
    assert {n for n, _ in model.named_parameters()} == before  # checkpoints keep their names
    assert prepare_float8(build_model(TINY, "meta"), resolve_precision(TrainConfig(precision="bf16"))) == []


@NEEDS_FP8_GPU
def test_fp8_trains_on_a_gpu(tmp_path, tiny_data):
    from tests.helpers import TINY_MODEL, read_metrics, run_suite

    model = [a for a in TINY_MODEL if not a.startswith("train.precision=")]
    args = [f"data.path={tiny_data}", f"run.dir={tmp_path / 'run'}", *model, "train.max_steps=4"]
    run_suite(
        "pretrain", *args, "train.precision=fp8", "train.log_every=1", "train.compile=false", check=True
    )
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"] + 0.5 and "mem_reserved_gb" in records[-1]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (offload moves state to the host)"
)
def test_offload_trains_on_one_gpu(tmp_path, tiny_data):
    """parallel.offload=true in one process on a GPU (FSDP2 CPUOffloadPolicy on a one-rank group):
    parameters, gradients and AdamW state live in pinned host memory, so the GPU's allocator peak
    falls below the plain run's, and the losses follow the plain run's."""
    from tests.helpers import TINY_MODEL, read_metrics, run_suite, summary

    wider = ["model.hidden_size=256", "model.num_layers=4", "train.max_steps=3", "train.log_every=1"]
    common = [f"data.path={tiny_data}", *TINY_MODEL, *wider, "train.device=cuda"]
    run_suite("pretrain", *common, f"run.dir={tmp_path / 'plain'}", check=True)
    run_suite("pretrain", *common, "parallel.offload=true", f"run.dir={tmp_path / 'off'}", check=True)
    assert summary(tmp_path / "off")["layout"]["ranks"][0]["modules"]["fsdp_offload"]
    plain = {r["step"]: r for r in read_metrics(tmp_path / "plain") if "loss" in r}
    off = {r["step"]: r for r in read_metrics(tmp_path / "off") if "loss" in r}
    assert plain.keys() == off.keys() == {1, 2, 3}
    for step in plain:
        assert off[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-4), step
    assert off[3]["mem_allocated_gb"] < plain[3]["mem_allocated_gb"], (off[3], plain[3])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="parallel.offload needs 2 CUDA GPUs (sharding=2)")
def test_offload_trains_on_gpus(tmp_path, tiny_data):
    """parallel.offload=true: FSDP2's CPUOffloadPolicy keeps sharded parameters, gradients and
    optimizer state in host memory; the run trains and its losses follow the plain FSDP run's."""
    from tests.helpers import TINY_MODEL, run_suite, train_losses

    common = [f"data.path={tiny_data}", *TINY_MODEL, "train.max_steps=3", "parallel.sharding=2"]
    common += ["parallel.sharding_stage=3", "launch.nproc_per_node=2", "parallel.global_batch_size=4"]
    run_suite("pretrain", *common, f"run.dir={tmp_path / 'plain'}", check=True)
    run_suite("pretrain", *common, "parallel.offload=true", f"run.dir={tmp_path / 'off'}", check=True)
    plain, off = train_losses(tmp_path / "plain"), train_losses(tmp_path / "off")
    assert plain.keys() == off.keys()
    for step in plain:
        assert off[step] == pytest.approx(plain[step], rel=1e-4), step


def test_fp8_with_tensor_or_pipeline_parallelism_is_refused(monkeypatch):
    from types import SimpleNamespace

    from suite import runtime
    from suite.config.schema import SuiteConfig

    monkeypatch.setattr(runtime, "check_fp8", lambda device: None)  # as on a Hopper GPU
    cfg = SuiteConfig(train=TrainConfig(precision="fp8"))
    runtime.check_precision(cfg, SimpleNamespace(tp=1, pp=1))
    with pytest.raises(
        ConfigError, match="train.precision=fp8 with parallel.tp=2 parallel.pp=1 is not supported"
    ):
        runtime.check_precision(cfg, SimpleNamespace(tp=2, pp=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_the_gpu_benchmark_says_it_needs_a_gpu():
    import subprocess
    import sys

    from tests.helpers import REPO, suite_env

    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py")],
        capture_output=True,
        text=True,
        env=suite_env(),
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr, proc.stderr
