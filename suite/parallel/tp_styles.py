"""The DTensor ParallelStyles of suite's tensor-parallel plans beyond torch's Colwise/Rowwise/
SequenceParallel: `Replicated` (whole parameters on every tp rank), `HeadwiseNorm` (Qwen3's
per-head q/k norms), `SharedAcrossHeads` (MLA's shared RoPE key) and the LoRA-aware linears.
suite.parallel.tensor_parallel (the dense plans) and suite.parallel.expert_tensor_parallel (the MoE
router) both use them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle


def _replicated(t: object, mesh: DeviceMesh) -> object:
    """A module input as a Replicate DTensor: a plain tensor (the same on every rank) wrapped, a
    DTensor (a sequence-parallel activation gathered by PrepareModuleInput) redistributed."""
    if isinstance(t, DTensor):
        return t.redistribute(mesh, [Replicate()])
    if isinstance(t, torch.Tensor):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return t


class Replicated(ParallelStyle):
    """Every tp rank holds the module's parameters whole (Replicate DTensors); plain tensors in and out.

    Used for what tensor parallelism does not split, so that every parameter of the model is a
    DTensor on the tp mesh (one layout family for the optimizer, FSDP and the gradient norm):
    norms without sequence parallelism, and the learned position table. With
    `shard_output_sequence` the output keeps only this rank's contiguous sequence slice (position
    embeddings under sp: no communication forward; backward all-gathers the slices' gradients,
    so the replicated table's gradient is complete on every rank).
    """

    def __init__(self, shard_output_sequence: bool = False):
        super().__init__()
        self.shard_output_sequence = shard_output_sequence

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard = self.shard_output_sequence

        def input_fn(mod, inputs, mesh):
            return tuple(_replicated(t, mesh) for t in inputs)

        def output_fn(mod, output, mesh):
            if shard:
                # [s, h] or [b, s, h]: the sequence is the second-to-last dim
                output = output.redistribute(mesh, [Shard(output.ndim - 2)])
            return output.to_local()

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


class HeadwiseNorm(ParallelStyle):
    """A norm over each head's width (Qwen3's q/k norms) behind a column-parallel projection: the
    input holds this rank's heads ([b, s, local heads, head_dim], Shard on the heads dim) and the
    weight is whole on every rank, so its gradient sums the ranks' heads, as SequenceParallel's
    norms sum the ranks' positions."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(t, mesh, [Shard(t.ndim - 2)], run_check=False)
                if isinstance(t, torch.Tensor)
                else t
                for t in inputs
            )

        def output_fn(mod, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


class SharedAcrossHeads(ParallelStyle):
    """A replicated tensor that every head uses (MLA's shared RoPE key): whole on every rank going
    in, and its gradient, which each rank computes for its own heads only, summed over the ranks
    coming back (the local output's gradient is read as Partial)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(_replicated(t, mesh) for t in inputs)

        def output_fn(mod, output, mesh):
            return output.to_local(grad_placements=[Partial()])

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list]) -> None:
    """Replace the module's own parameters (not its children's) by DTensors with these placements."""
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        dt = distribute_tensor(param.data, mesh, placement, src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class LoRAColwise(ParallelStyle):
    """ColwiseParallel for a LoRA-adapted linear (suite.models.lora.LoRALinear): the base weight,
    its bias and lora_b are split on the output dim (Shard(0)), lora_a is replicated. Then x A^T is
    whole on every rank and (x A^T) B^T is this rank's slice of the output, like x W^T."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            if name == "":
                _distribute_params(mod, mesh, {"weight": [Shard(0)], "bias": [Shard(0)]})
            elif name == "lora_a":
                _distribute_params(mod, mesh, {"weight": [Replicate()]})
            elif name == "lora_b":
                _distribute_params(mod, mesh, {"weight": [Shard(0)]})

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            x = (
                x.redistribute(mesh, [Replicate()])
                if isinstance(x, DTensor)
                else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            )
            return (x, *inputs[1:])

        def output_fn(mod, output, mesh):
            return output.to_local()  # this rank's heads / hidden slice, as ColwiseParallel gives

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


class LoRARowwise(ParallelStyle):
    """RowwiseParallel for a LoRA-adapted linear: the base weight and lora_a are split on the input
    dim (Shard(1)), the bias and lora_b replicated. Both x W^T and (x A^T) B^T are then partial sums,
    and the one reduction (all-reduce, or reduce-scatter along the sequence with sp) covers both."""

    def __init__(self, output_layout=None):
        super().__init__()
        self.output_layout = output_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.output_layout

        def partition(name, mod, mesh):
            if name == "":
                _distribute_params(mod, mesh, {"weight": [Shard(1)], "bias": [Replicate()]})
            elif name == "lora_a":
                _distribute_params(mod, mesh, {"weight": [Shard(1)]})
            elif name == "lora_b":
                _distribute_params(mod, mesh, {"weight": [Replicate()]})

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
            return (x, *inputs[1:])

        def output_fn(mod, output, mesh):
            return output.redistribute(mesh, [layout]).to_local()

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)
