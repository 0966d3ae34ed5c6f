"""ZeRO-1 (parallel.sharding_stage=1): AdamW's state sharded over the data-parallel ranks, parameters
and gradients replicated. An optimizer concern, so it lives with the optimizers; the layout it
shards over (the data mesh) comes from the placement (suite.parallel)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from suite.parallel.data_parallel import canonical_name
from suite.parallel.expert_parallel import expert_params_of
from suite.train.wrapped_optim import WrappedOptimizer


def _row_slice(rows: int, parts: int, index: int) -> tuple[int, int, int]:
    """(offset, length, padded chunk) of piece `index` of `rows` split like torch.chunk."""
    chunk = math.ceil(rows / parts) if rows else 0
    offset = min(index * chunk, rows)
    return offset, max(0, min(chunk, rows - offset)), chunk


class ZeroOneOptimizer(WrappedOptimizer):
    """An optimizer whose state covers only this rank's 1/N row slice of every parameter (expert-parallel
    weights excepted: they are split over ep already, and each rank keeps their whole state).

    Wraps an already built optimizer (from suite.train.optim) over the model's parameters and
    re-points it at DTensor views of this rank's rows (Shard(0) over the `sharding` mesh axis,
    replicated over `dp`, composed with the tensor-parallel placement), so the update writes
    straight into the replicated parameters. After the step the slices are all-gathered.

    Checkpoints: `dcp_state_dict()` has the same keys as DCP's `get_state_dict` for any layout
    (FQN-keyed, DTensor values with their global layout), so a ZeRO-1 run resumes a stage-3 run's
    checkpoint and the other way round.
    """

    def __init__(
        self, model: nn.Module, inner: torch.optim.Optimizer, mesh: DeviceMesh, bucket_mb: float = 64
    ):
        self.model = model
        self.inner = inner
        self.group = mesh.get_group("sharding")
        self.parts = mesh.size(mesh.mesh_dim_names.index("sharding"))
        self.index = mesh.get_local_rank("sharding")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.entries: list[dict] = []
        shard_of: dict[int, nn.Parameter] = {}
        # expert-parallel weights are already split over their own mesh axis (ep): each rank keeps the
        # whole state of its experts, as under FSDP, which leaves them out too
        experts = {id(p) for p in expert_params_of(model)}
        for name, param in model.named_parameters():
            if id(param) in experts:
                entry = {"fqn": canonical_name(name), "param": param, "shard": param, "whole": True}
            else:
                entry = self._make_shard(canonical_name(name), param, mesh)
            self.entries.append(entry)
            shard_of[id(param)] = entry["shard"]
        for group in inner.param_groups:
            group["params"] = [shard_of[id(p)] for p in group["params"]]
        if inner.state:
            raise RuntimeError("ZeroOneOptimizer needs a fresh optimizer (no state yet)")

    def _make_shard(self, fqn: str, param: nn.Parameter, mesh: DeviceMesh) -> dict:
        local = param._local_tensor if isinstance(param, DTensor) else param.data
        tp_placements: tuple = ()
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            tp_placements = tuple(p for n, p in zip(names, param.placements) if n == "tp")
        offset, length, chunk = _row_slice(local.shape[0], self.parts, self.index)
        view = local.narrow(0, offset, length)
        if tp_placements:
            tp_size = mesh.size(mesh.mesh_dim_names.index("tp"))
            split = any(isinstance(p, Shard) and p.dim == 0 for p in tp_placements)
            row = _StridedShard(0, split_factor=tp_size) if split else Shard(0)
            spec_mesh, placements = mesh["dp", "sharding", "tp"], (Replicate(), row, *tp_placements)
        else:
            spec_mesh, placements = mesh["dp", "sharding"], (Replicate(), Shard(0))
        shard = nn.Parameter(
            DTensor.from_local(
                view, spec_mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
            ),
            requires_grad=param.requires_grad,
        )
        return {
            "fqn": fqn,
            "param": param,
            "local": local,
            "shard": shard,
            "offset": offset,
            "length": length,
            "chunk": chunk,
            "mesh": spec_mesh,
            "placements": placements,
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for e in self.sliced:
            e["shard"].grad = None

    @property
    def sliced(self) -> list[dict]:
        """The entries whose state this rank holds a row slice of (all but the expert weights)."""
        return [e for e in self.entries if not e.get("whole")]

    def _update(self) -> None:
        for e in self.sliced:
            grad = e["param"].grad
            if grad is None:
                e["shard"].grad = None
                continue
            g = grad._local_tensor if isinstance(grad, DTensor) else grad
            e["shard"].grad = DTensor.from_local(
                g.narrow(0, e["offset"], e["length"]),
                e["mesh"],
                e["placements"],
                run_check=False,
                shape=e["param"].shape,
                stride=e["param"].stride(),
            )
        self.inner.step()
        self._gather_slices()

    def _gather_slices(self) -> None:
        """All-gather every rank's updated rows into the full parameters, in size-capped buckets."""
        by_dtype: dict[torch.dtype, list[dict]] = defaultdict(list)
        for e in self.sliced:
            by_dtype[e["local"].dtype].append(e)
        for entries in by_dtype.values():
            bucket, size = [], 0
            for e in entries:
                bucket.append(e)
                size += e["chunk"] * _row_numel(e["local"]) * e["local"].element_size()
                if size >= self.bucket_bytes:
                    self._gather_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self._gather_bucket(bucket)

    def _gather_bucket(self, bucket: list[dict]) -> None:
        sizes = [e["chunk"] * _row_numel(e["local"]) for e in bucket]
        total = sum(sizes)
        ref = bucket[0]["local"]
        send = ref.new_zeros(total)
        offsets, at = [], 0
        for e, n in zip(bucket, sizes):
            offsets.append(at)
            rows = e["local"].narrow(0, e["offset"], e["length"])
            send[at : at + rows.numel()].copy_(rows.reshape(-1))
            at += n
        recv = ref.new_empty(self.parts * total)
        dist.all_gather_into_tensor(recv, send, group=self.group)
        recv = recv.view(self.parts, total)
        for e, n, at in zip(bucket, sizes, offsets):
            local = e["local"]
            full = recv[:, at : at + n].reshape(self.parts * e["chunk"], *local.shape[1:])
            local.copy_(full[: local.shape[0]])

    # ---- checkpoints -------------------------------------------------------------------------------
    def _init_state(self) -> None:
        for e in self.entries:
            shard = e["shard"]
            if shard not in self.inner.state or not self.inner.state[shard]:
                empty = getattr(self.inner, "empty_state", None)  # optim=muon: its groups' own keys
                self.inner.state[shard] = (
                    empty(shard)
                    if empty is not None
                    else {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(shard.detach()),
                        "exp_avg_sq": torch.zeros_like(shard.detach()),
                    }
                )

    def dcp_state_dict(self, for_loading: bool = False) -> dict:
        """FQN-keyed state like `get_optimizer_state_dict` (loaded in place by dcp.load)."""
        if for_loading:
            self._init_state()
        fqn_of = {id(e["shard"]): e["fqn"] for e in self.entries}
        state = {fqn_of[id(s)]: dict(st) for s, st in self.inner.state.items() if st}
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": [fqn_of[id(p)] for p in g["params"]]}
            for g in self.inner.param_groups
        ]
        if for_loading:
            return {"state": state}
        return {"state": state, "param_groups": groups}

    def dcp_load_state_dict(self, state: dict) -> None:
        """After dcp.load filled the tensors of `dcp_state_dict(for_loading=True)` in place."""
        by_fqn = {e["fqn"]: e["shard"] for e in self.entries}
        for fqn, st in state["state"].items():
            target = self.inner.state[by_fqn[fqn]]
            for key, value in st.items():
                if target.get(key) is not value:
                    target[key] = value


def _row_numel(t: torch.Tensor) -> int:
    return t[0].numel() if t.dim() > 0 and t.shape[0] else (math.prod(t.shape[1:]) if t.dim() else 1)
