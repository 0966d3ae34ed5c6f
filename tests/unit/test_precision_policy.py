"""The precision policy: train.precision and train.param_dtype resolved once into dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from suite.config.schema import TrainConfig
from suite.runtime import resolve_precision

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("precision", "param_dtype", "compute", "params", "autocast", "master", "scaler"),
    [
        ("fp32", "fp32", F32, F32, None, None, False),
        ("bf16", "fp32", BF16, F32, BF16, None, False),
        ("bf16", "bf16", BF16, BF16, None, F32, False),
        ("fp16", "fp32", F16, F32, F16, None, True),
    ],
)
def test_each_recipe_setting_resolves_to_its_dtypes(
    precision, param_dtype, compute, params, autocast, master, scaler
):
    policy = resolve_precision(
        TrainConfig(precision=precision, param_dtype=param_dtype), torch.device("cuda")
    )
    assert (policy.name, policy.compute_dtype, policy.param_dtype) == (precision, compute, params)
    assert (policy.autocast_dtype, policy.master_dtype, policy.grad_scaler) == (autocast, master, scaler)
    assert policy.reduce_dtype == F32 and not policy.emulated  # cuda: never emulated
    assert policy.param_dtype_name == param_dtype
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.name = "fp16"  # type: ignore[misc]


def test_auto_and_emulation_follow_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    cpu = torch.device("cpu")
    assert resolve_precision(TrainConfig(precision="auto", device="cpu"), cpu).name == "fp32"
    assert resolve_precision(TrainConfig(precision="bf16"), cpu).emulated
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_precision(TrainConfig(precision="auto", device="cpu"), cpu).name == "bf16"
    assert not resolve_precision(TrainConfig(precision="bf16"), cpu).emulated
