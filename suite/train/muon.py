"""optim=muon: Muon (momentum orthogonalised by a Newton-Schulz iteration) for the hidden matrices,
AdamW for everything else (embeddings, the output head, norms, biases, the MoE router), in one
optimizer so that the lr schedule, checkpoints (DCP) and the wrappers (fp32 masters, ZeRO-1) see a
single torch optimizer.

The update is torch.optim.Muon's (torch 2.13, single device), written out so that it also runs on
DTensor parameters. A matrix sharded by rows over one mesh axis (FSDP2's Shard(0), ZeRO-1's row
slices) is orthogonalised whole, once, on one rank of that axis: the matrices of a step are dealt
round-robin over its ranks (largest first), each owner gathers its matrices' rows (`dist.gather`),
runs Newton-Schulz and scatters the rows back (`dist.scatter`); `MuonWithAdamW.comm` counts the work
and the bytes for summary.json. Replicated matrices (dp, cp) are orthogonalised on every rank from the
same averaged gradient (no communication); any other placement is gathered whole on every rank.
A tensor-parallel matrix (rows or columns over tp) is dealt round-robin over the tp ranks the same way.
A 3-D stack of expert matrices split on its expert dim (expert parallelism's Shard(0) over ep, and
FSDP2's or ZeRO-1's rows of a stack) holds whole matrices on every rank: each rank orthogonalises its
own experts, once, without communication (replicas over edp each do their own, as dp ranks do).
tp with sharding or with ep, and pipeline parallelism are refused (`check_muon_layout`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic iteration)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def is_muon_param(name: str, ndim: int, exclude: list[str]) -> bool:
    """The role by name and shape: 2-D matrices inside the transformer blocks (attention and MLP
    projections; 3-D stacked expert weights, one matrix per expert). Embeddings, the output head,
    norms and biases live outside `layers.` or are 1-D; `exclude` (optim.muon_exclude) keeps
    matching names (the router and LoRA adapters by default) on AdamW. The planner asks it too
    (suite.plan.muon_cost), with the shapes it counts."""
    return name.startswith("layers.") and ndim in (2, 3) and not any(part in name for part in exclude)


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


def matrices(t: Tensor) -> int:
    """How many matrices a Muon tensor holds: a 3-D stack one per expert (what `comm` counts)."""
    return t.shape[0] if t.ndim == 3 else 1


def holds_whole_experts(t: Tensor) -> bool:
    """A DTensor stack of expert matrices split only on its expert dim (ep's Shard(0), FSDP2's or
    ZeRO-1's rows of a 3-D tensor): every rank's part is whole matrices, orthogonalised in place."""
    if not isinstance(t, DTensor) or t.ndim != 3:
        return False
    mesh = t.device_mesh
    split = [p for i, p in enumerate(t.placements) if not isinstance(p, Replicate) and mesh.size(i) > 1]
    return all(type(p) is Shard and p.dim == 0 for p in split)


def orthogonalise_local(update: DTensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Newton-Schulz of each expert matrix this rank holds (`holds_whole_experts`), as the same DTensor."""
    local = update.to_local()
    ortho = newton_schulz(local, steps, dtype) if local.shape[0] else local.to(dtype, copy=True)
    return DTensor.from_local(
        ortho,
        update.device_mesh,
        update.placements,
        run_check=False,
        shape=update.shape,
        stride=update.stride(),
    )


def orthogonalise(update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Newton-Schulz of the whole matrix; a DTensor is gathered whole and every rank keeps its part
    (the fallback for placements `shard_axis` does not take)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    whole = newton_schulz(update.full_tensor(), steps, dtype)
    # every rank computed the same whole result: keep this rank's part without communication
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


def shard_axis(t: Tensor) -> int | None:
    """The one mesh axis a DTensor is split over (a plain Shard: FSDP2's and ZeRO-1's rows, tensor
    parallelism's rows or columns; every other axis Replicate), or None: a plain tensor, a replicated
    one, or a placement the round-robin scheme does not take (tp combined with sharding)."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh  # a one-rank axis (replicate's shard group) splits nothing
    sharded = [i for i, p in enumerate(t.placements) if not isinstance(p, Replicate) and mesh.size(i) > 1]
    return sharded[0] if len(sharded) == 1 and type(t.placements[sharded[0]]) is Shard else None


class _Owned:
    """One sharded matrix on its way through gather -> Newton-Schulz (on its owner) -> scatter."""

    def __init__(self, update: DTensor, axis: int):
        self.update, self.axis = update, axis
        self.dim = update.placements[axis].dim  # type: ignore[union-attr]
        self.group = update.device_mesh.get_group(axis)
        self.parts = update.device_mesh.size(axis)
        self.index = update.device_mesh.get_local_rank(axis)
        self.local = update._local_tensor
        self.size = update.shape[self.dim]
        self.chunk = math.ceil(self.size / self.parts)  # torch.chunk's split, as Shard has it

    def length(self, index: int) -> int:
        return max(0, min(self.chunk, self.size - index * self.chunk))

    def empty(self, dtype: torch.dtype) -> Tensor:
        """A rank's padded part (`chunk` along the shard dim), uninitialised."""
        shape = list(self.update.shape)
        shape[self.dim] = self.chunk
        return self.local.new_empty(shape, dtype=dtype)

    def padded(self, t: Tensor) -> Tensor:
        out = self.empty(t.dtype).zero_()
        out.narrow(self.dim, 0, t.shape[self.dim]).copy_(t)
        return out


def orthogonalise_round_robin(
    updates: list[Tensor], steps: int, dtype: torch.dtype, comm: dict
) -> list[Tensor]:
    """Each update's Newton-Schulz result, computed once per matrix: sharded matrices are dealt
    round-robin (largest first) over the ranks of their shard axis, gathered whole on their owner and
    scattered back; the rest as `orthogonalise`. Adds this rank's work and bytes to `comm`."""
    results: list[Tensor | None] = [None] * len(updates)
    sharded: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        axis = shard_axis(u)
        if holds_whole_experts(u):  # this rank's experts, here and nowhere else
            results[i] = orthogonalise_local(u, steps, dtype)  # type: ignore[arg-type]
            comm["orthogonalised"] += u.to_local().shape[0]  # type: ignore[union-attr]
        elif axis is None:
            results[i] = orthogonalise(u, steps, dtype)
            comm["orthogonalised"] += matrices(u)
        else:
            sharded.setdefault((id(u.device_mesh.get_group(axis)), axis), []).append(i)
    for (_, axis), indices in sharded.items():
        jobs = [_Owned(updates[i], axis) for i in indices]
        order = sorted(range(len(jobs)), key=lambda j: -jobs[j].update.numel())  # the same on every rank
        owner = {j: k % jobs[0].parts for k, j in enumerate(order)}
        gathered, waits = {}, []
        for j, job in enumerate(jobs):  # every rank issues the same collectives in the same order
            mine = owner[j] == job.index
            gathered[j] = [job.empty(job.local.dtype) for _ in range(job.parts)] if mine else None
            waits.append(
                dist.gather(
                    job.padded(job.local), gathered[j], group=job.group, group_dst=owner[j], async_op=True
                )
            )
        for w in waits:
            w.wait()
        scatter_from: dict[int, list[Tensor] | None] = {}
        for j, job in enumerate(jobs):
            if owner[j] != job.index:
                scatter_from[j] = None
                continue
            whole = torch.cat(gathered[j], dim=job.dim).narrow(job.dim, 0, job.size)
            ortho = newton_schulz(whole, steps, dtype)
            comm["orthogonalised"] += matrices(whole)
            moved = job.update.numel() - job.local.numel()  # the other ranks' parts
            comm["gathered_bytes"] += moved * job.local.element_size()
            comm["scattered_bytes"] += moved * ortho.element_size()
            parts = [job.padded(part) for part in ortho.split(job.chunk, dim=job.dim)]
            scatter_from[j] = parts + [job.padded(ortho.narrow(job.dim, 0, 0))] * (job.parts - len(parts))
        received, waits = {}, []
        for j, job in enumerate(jobs):
            received[j] = job.empty(dtype)
            waits.append(
                dist.scatter(received[j], scatter_from[j], group=job.group, group_src=owner[j], async_op=True)
            )
        for w in waits:
            w.wait()
        for i, (j, job) in zip(indices, enumerate(jobs)):
            mine = received[j].narrow(job.dim, 0, job.length(job.index)).contiguous()
            u = job.update
            results[i] = DTensor.from_local(
                mine, u.device_mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride()
            )
    return results  # type: ignore[return-value]


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW whose groups flagged `muon` get Muon's update instead (state: `momentum_buffer`, `step`).

    Being an AdamW keeps the trainer's use of it (param_groups, state_dict, DCP) unchanged; the
    Muon groups are never fused, so the step skips non-finite updates on the host
    (suite.train.step: `skips_on_device` needs every group fused). `orthogonalised` counts the
    matrices orthogonalised on this rank over the run (a stack of experts counts each); `comm` is the
    last step's work on this rank (matrices orthogonalised, bytes gathered and scattered:
    summary.json `muon_per_step`, tests assert it)."""

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
        self.comm = {"orthogonalised": 0, "gathered_bytes": 0, "scattered_bytes": 0}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm = dict.fromkeys(self.comm, 0)
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        self.orthogonalised += self.comm["orthogonalised"]
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        params, updates = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(self.empty_state(p))
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            params.append(p)
            updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        dtype = NS_DTYPES[group["ns_dtype"]]
        for p, update in zip(params, orthogonalise_round_robin(updates, group["ns_steps"], dtype, self.comm)):
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


def muon_of(optimizer) -> MuonWithAdamW | None:
    """The Muon optimizer inside the wrappers (ZeRO-1, fp32 masters), or None (optim=adamw)."""
    while not isinstance(optimizer, MuonWithAdamW):
        optimizer = getattr(optimizer, "inner", None)
        if optimizer is None:
            return None
    return optimizer


def check_muon_layout(cfg: SuiteConfig, dims) -> None:
    """optim=muon runs on one process, data parallelism (dp, cp), sharding (ZeRO-1, FSDP2), tensor
    parallelism (with dp) and expert parallelism (without tp), where each matrix is orthogonalised
    whole; tp with sharding (strided shards), tp with ep (experts split over two axes) and pp are
    not built yet."""
    if cfg.optim.name == "muon":
        check_muon_dims(dims, cfg.parallel.offload)


def check_muon_dims(dims, offload: bool) -> None:
    """The layouts optim=muon refuses (the trainer's preflight and the planner's check_layout)."""
    if dims.tp > 1 and dims.sharding > 1:
        raise ConfigError(
            f"optim.name=muon with parallel.tp={dims.tp} and parallel.sharding={dims.sharding} is not "
            "supported yet; use parallel.tp with parallel.dp, or parallel.sharding without tp, or optim=adamw"
        )
    if dims.tp > 1 and dims.ep > 1:
        raise ConfigError(
            f"optim.name=muon with parallel.tp={dims.tp} and parallel.ep={dims.ep} is not supported yet "
            "(each expert split over tp); use parallel.ep without tp, or optim=adamw"
        )
    if dims.pp > 1:
        raise ConfigError(
            f"optim.name=muon with parallel.pp={dims.pp} is not supported yet (Muon orthogonalises whole "
            "matrices); use parallel.dp / parallel.sharding, or optim=adamw"
        )
    if offload:
        raise ConfigError(
            "optim.name=muon with parallel.offload=true is not supported yet; turn offload off, or use optim=adamw"
        )
