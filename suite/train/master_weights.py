"""`train.param_dtype=bf16`: the model holds bf16 parameters and gradients, the optimizer fp32 master copies.

Under autocast (`param_dtype=fp32`) every forward re-casts each fp32 weight to bf16 and every backward
casts each bf16 weight gradient back to fp32. Here the model's parameters are bf16 themselves, so
forward and backward run without those copies; `MasterWeightOptimizer` keeps an fp32 master copy of every
parameter and the AdamW state in fp32, copies the bf16 gradients into fp32 before the update and the
updated masters back into the bf16 parameters after it. The fp32 masters are the saved truth:
checkpoints hold them under the model's own names (the same files as a `param_dtype=fp32` run), so
either setting resumes the other's checkpoints, and `suite generate` / `suite export` read fp32 weights.

Layouts with data parallelism (dp, sharding, cp) get the same thing from FSDP2's own
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (suite.parallel.data_parallel), whose
sharded fp32 parameters are the masters; this class serves the layouts without a data-parallel wrapper.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from suite.train.wrapped_optim import WrappedOptimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MasterWeightOptimizer(WrappedOptimizer):
    """An optimizer over fp32 master copies of a model whose parameters it turns into `dtype`.

    `make_inner(param_groups)` builds the real optimizer (AdamW) over the masters, given groups shaped
    like the model's (same options, masters in place of the parameters). Build it on the fp32 model
    right after initialisation: the masters start from the exact fp32 values.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: list[dict],
        make_inner: Callable[[list[dict]], torch.optim.Optimizer],
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.model = model
        self.params: list[nn.Parameter] = []  # the model's, in the order of `masters`
        self.masters: list[nn.Parameter] = []
        master_of: dict[int, nn.Parameter] = {}
        for group in groups:
            for p in group["params"]:
                if id(p) not in master_of:
                    master = nn.Parameter(p.detach().float().clone())
                    master_of[id(p)] = master
                    self.params.append(p)
                    self.masters.append(master)
        self.master_of = master_of
        inner_groups = [{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in groups]
        self.inner = make_inner(inner_groups)
        with torch.no_grad():
            for p in model.parameters():  # every parameter, frozen ones too (they are cast for compute)
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        # model names of every parameter (tied weights: several names, one master)
        self.names: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in master_of:
                self.names[name] = master_of[id(p)]

    def _update(self) -> None:
        # fp32 gradients exist only during the update, each replacing its bf16 gradient: the model's
        # state never holds both at once (peak memory at or below the autocast run's fp32 gradients)
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.inner.step()
        for master in self.masters:
            master.grad = None
        self._copy_masters()  # round the updated masters into the bf16 params

    # ---- checkpoints: the masters under the model's names ------------------------------------------
    def dcp_model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with each parameter's fp32 master in its place (buffers as they are)."""
        state = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            state[name] = self.names[name].detach() if name in self.names else value.detach()
        return state

    def sync_params(self) -> None:
        """Copy the masters into the model's parameters (after loading the masters)."""
        with torch.no_grad():
            self._copy_masters()

    def _copy_masters(self) -> None:
        # DTensor (tensor-parallel) parameters and their masters share placements: copy the local shards
        # (DTensor has no sharding rule for the foreach copy)
        torch._foreach_copy_([_local(p) for p in self.params], [_local(m) for m in self.masters])

    def dcp_state_dict(self, for_loading: bool = False) -> dict:
        """FQN-keyed state like `get_optimizer_state_dict` (loaded in place by dcp.load)."""
        name_of = {}
        for name, master in self.names.items():
            name_of.setdefault(id(master), name)  # tied: the first name, as get_state_dict writes it
        if for_loading:
            for master in self.masters:
                if not self.inner.state.get(master):
                    self.inner.state[master] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(master.detach()),
                        "exp_avg_sq": torch.zeros_like(master.detach()),
                    }
        state = {name_of[id(m)]: dict(st) for m, st in self.inner.state.items() if st}
        if for_loading:
            return {"state": state}
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": [name_of[id(p)] for p in g["params"]]}
            for g in self.inner.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def dcp_load_state_dict(self, state: dict) -> None:
        """After dcp.load filled the tensors of `dcp_state_dict(for_loading=True)` in place."""
        for name, st in state["state"].items():
            target = self.inner.state[self.names[name]]
            for key, value in st.items():
                if target.get(key) is not value:
                    target[key] = value
