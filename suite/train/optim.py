"""AdamW with Megatron's parameter groups: no weight decay on biases, norms, 1-D tensors and learned
quantization scales; optim=muon moves the hidden matrices into a Muon group (suite.train.muon)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from suite.config.schema import OptimConfig
from suite.models.qat import learned_scale_ratios
from suite.runtime import auto_precision
from suite.train.master_weights import MasterWeightOptimizer
from suite.train.muon import MuonWithAdamW, is_muon_param
from suite.train.wrapped_optim import WrappedOptimizer
from suite.train.zero1 import ZeroOneOptimizer

__all__ = ["WrappedOptimizer", "build_optimizer", "optimizer_for", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float, scale_lr: float = 1.0) -> list[dict]:
    """Decayed weights, undecayed 1-D tensors, and (compress=qat-* with learned scales) the scales:
    step sizes, not weights (no decay; `lr_ratio` times the scheduled lr, suite.models.qat)."""
    decay, no_decay, scales = [], [], {}
    ratios = learned_scale_ratios(model, scale_lr)
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in ratios:
            scales.setdefault(ratios[id(param)], []).append(param)
        else:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ] + [{"params": ps, "weight_decay": 0.0, "lr_ratio": ratio} for ratio, ps in scales.items()]


def muon_groups(model: nn.Module, groups: list[dict], exclude: list[str]) -> list[dict]:
    """The decayed group split in two: the hidden matrices (a `muon` group) and the rest (AdamW)."""
    names = {id(p): name for name, p in model.named_parameters()}
    decay, *rest = groups
    muon = [p for p in decay["params"] if is_muon_param(names[id(p)], p.ndim, exclude)]
    chosen = {id(p) for p in muon}
    adamw = [p for p in decay["params"] if id(p) not in chosen]
    return [{**decay, "params": adamw}, *rest, {**decay, "params": muon, "muon": True}]


def ns_dtype(value: str, device: torch.device) -> str:
    """optim.muon_ns_dtype, `auto` settled for `device` (a config that skipped suite.runtime.resolve_auto):
    bf16 where it computes bf16 natively, else fp32."""
    if value != "auto":
        return value
    return "bf16" if auto_precision(device.type) == "bf16" else "fp32"


def optimizer_for(placement, cfg: OptimConfig, scale_lr: float = 1.0) -> torch.optim.Optimizer:
    """AdamW over what this rank holds (a suite.parallel.Placement); ZeRO-1: over its slice of it.
    With a data-parallel wrapper FSDP2's MixedPrecisionPolicy keeps the fp32 masters
    (suite.parallel.data_parallel), so train.param_dtype applies only without one."""
    device = placement.optim_device or placement.param_device()
    param_dtype = placement.param_dtype if placement.dp_kind == "none" else torch.float32
    optimizer = build_optimizer(placement.model, cfg, device, param_dtype, scale_lr)
    if placement.dp_kind == "zero1":
        return ZeroOneOptimizer(placement.model, optimizer, placement.mesh)  # type: ignore[return-value]
    return optimizer


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, param_dtype: torch.dtype, scale_lr: float = 1.0
) -> torch.optim.Optimizer:
    """AdamW, fused by default where it is known to work: CUDA, and CPU with plain (non-DTensor)
    parameters; foreach otherwise. optim.fused=true/false forces the choice.

    On CPU the fused kernel took ~6x less CPU time than foreach per step (16.8M parameters, one
    thread, torch 2.13: 12 ms vs 71 ms; `python bench/adamw_step.py`, docs/performance.md).
    param_dtype=torch.bfloat16 (train.param_dtype): the model's parameters become bf16 and the AdamW runs on
    fp32 master copies (suite.train.master_weights); build it right after the fp32 initialisation.
    """
    fused = cfg.fused
    if fused is None:
        plain = not any(isinstance(p, DTensor) for p in model.parameters())
        fused = device.type == "cuda" or (device.type == "cpu" and plain)
    kwargs = {"fused": True} if fused else {"foreach": True}

    def adamw(groups: list[dict]) -> torch.optim.Optimizer:
        options = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, **kwargs}
        if cfg.name == "muon":
            return MuonWithAdamW(
                groups,
                momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps,
                adjust_lr=cfg.muon_adjust_lr,
                ns_dtype=ns_dtype(cfg.muon_ns_dtype, device),
                **options,
            )
        return torch.optim.AdamW(groups, **options)

    groups = param_groups(model, cfg.weight_decay, scale_lr)  # scale_lr: compress.scale_lr
    if cfg.name == "muon":
        groups = muon_groups(model, groups, cfg.muon_exclude)
    if param_dtype != torch.float32:
        return MasterWeightOptimizer(model, groups, adamw, param_dtype)  # type: ignore[return-value]
    return adamw(groups)
