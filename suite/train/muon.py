"""optim=muon: Muon (momentum orthogonalised by a Newton-Schulz iteration) for the hidden matrices,
AdamW for everything else (embeddings, the output head, norms, biases, the MoE router), in one
optimizer so that the lr schedule, checkpoints (DCP) and the wrappers (fp32 masters, ZeRO-1) see a
single torch optimizer.

The update is torch.optim.Muon's (torch 2.13, single device), written out so that it also runs on
DTensor parameters: a sharded matrix (FSDP2, ZeRO-1) is gathered whole, orthogonalised on every rank
of its group (the same input, the same result) and each rank keeps its own rows, which is exactly
the one-process update at the cost of an all-gather per matrix and redundant Newton-Schulz work.
Tensor, expert and pipeline parallelism are refused (`check_muon_layout`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic iteration)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def is_muon_param(name: str, param: nn.Parameter, exclude: list[str]) -> bool:
    """The role by name and shape: 2-D matrices inside the transformer blocks (attention and MLP
    projections; 3-D stacked expert weights, one matrix per expert). Embeddings, the output head,
    norms and biases live outside `layers.` or are 1-D; `exclude` (optim.muon_exclude) keeps
    matching names (the router and LoRA adapters by default) on AdamW."""
    return name.startswith("layers.") and param.ndim in (2, 3) and not any(part in name for part in exclude)


def newton_schulz(
    grad: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, eps: float = NS_EPS
) -> Tensor:
    """torch.optim.Muon's orthogonalisation, op for op (in bf16 there, `dtype` here; the wide
    orientation), on one matrix or on each matrix of a stack."""
    if grad.ndim == 3:
        return torch.stack([newton_schulz(g, steps, dtype, eps) for g in grad.unbind(0)])
    a, b, c = NS_COEFFICIENTS
    x = grad.to(dtype, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, shape: torch.Size) -> float:
    """torch's `adjust_lr_fn`: match_rms_adamw (Moonlight: update RMS ~0.2 like AdamW's, so AdamW's
    lr and weight decay carry over), original (Keller Jordan: sqrt(max(1, rows/cols))), none."""
    rows, cols = shape[-2], shape[-1]
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if how == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


def orthogonalise(update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Newton-Schulz of the whole matrix; a DTensor is gathered whole and every rank keeps its part."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    whole = newton_schulz(update.full_tensor(), steps, dtype)
    # every rank computed the same whole result: keep this rank's part without communication
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW whose groups flagged `muon` get Muon's update instead (state: `momentum_buffer`, `step`).

    Being an AdamW keeps the trainer's use of it (param_groups, state_dict, DCP) unchanged; the
    Muon groups are never fused, so the step skips non-finite updates on the host
    (suite.train.step: `skips_on_device` needs every group fused). `orthogonalised` counts the
    Newton-Schulz calls on this rank (one per matrix per step; tests assert it)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        adjust_lr: str,
        ns_dtype: str = "bf16",
        **adamw_options,
    ):
        muon = {
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "adjust_lr": adjust_lr,
            "ns_dtype": ns_dtype,
        }
        groups = [{**muon, **g, "fused": False, "foreach": False} if g.get("muon") else g for g in groups]
        super().__init__(groups, **adamw_options)
        # GradScaler (fp16) must not hand its scale to the fused AdamW part: the Muon part ignores it
        self._step_supports_amp_scaling = False
        self.orthogonalised = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(self.empty_state(p))
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalise(update, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
            self.orthogonalised += 1
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))

    def empty_state(self, param: Tensor) -> dict:
        """A parameter's state before its first step (ZeRO-1 builds it to load a checkpoint into)."""
        group = next((g for g in self.param_groups if any(q is param for q in g["params"])), None)
        if group is None or not group.get("muon"):
            return {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param.detach()),
                "exp_avg_sq": torch.zeros_like(param.detach()),
            }
        return {"step": torch.tensor(0.0), "momentum_buffer": torch.zeros_like(param.detach())}


def check_muon_layout(cfg: SuiteConfig, dims) -> None:
    """optim=muon runs on one process, data parallelism (dp, cp) and sharding (ZeRO-1, FSDP2), where
    each matrix is orthogonalised whole; tp, ep and pp split or place matrices in ways not built yet."""
    if cfg.optim.name != "muon":
        return
    for key in ("tp", "ep", "pp"):
        if getattr(dims, key) > 1:
            raise ConfigError(
                f"optim.name=muon with parallel.{key}={getattr(dims, key)} is not supported yet (Muon "
                "orthogonalises whole matrices); use parallel.dp / parallel.sharding, or optim=adamw"
            )
    if cfg.parallel.offload:
        raise ConfigError(
            "optim.name=muon with parallel.offload=true is not supported yet; turn offload off, or use optim=adamw"
        )
