"""`Placement`: what a rank holds after `suite.parallel.parallelize.parallelize` (or the pipeline's
`build_pipeline`), and the communication its layout implies. The step reads it (suite.train.step);
it sits in its own module so that the orchestrator (parallelize) and the pipeline builder both
return one without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from suite.parallel.dims import ParallelDims
from suite.parallel.mesh import data_cp_mesh, data_mesh


@dataclass
class Placement:
    """What this rank holds after `parallelize`, and the communication its layout implies.

    Single process: `mesh` is None. Distributed: the mesh names the axes; `dp_kind` says which
    data-parallel wrapper is on the model (none, replicate, zero1, fsdp, hsdp); `loss_parallel`
    means the logits are vocab-sharded DTensors (run the loss under DTensor's loss_parallel);
    `gradient_hooks` run after every backward (expert-parallel replicas, the tied embedding across
    pipeline stages); `pipeline` describes this rank's stages when pp > 1. The step that runs on a
    placement lives in suite.train.step.
    """

    model: nn.Module
    dims: ParallelDims
    dp_rank: int = 0
    materialized: bool = False
    num_params: int = 0
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh when distributed
    loss_parallel: bool = False
    dp_kind: str = "none"
    optim_device: torch.device | None = None
    compute_device: torch.device | None = None  # offloaded FSDP: where batches go (params live on CPU)
    cp_rank: int = 0  # this rank's coordinate on the cp axis (which sequence chunks it holds)
    param_dtype: torch.dtype = (
        torch.float32
    )  # train.param_dtype without data parallelism (bf16: fp32 masters)
    ep_traffic: dict | None = None  # expert parallel: bytes sent by the all-to-alls (a running count)
    gradient_hooks: list[Callable[[], None]] = field(default_factory=list)
    pipeline: object = None  # suite.parallel.pipeline.PipelineStages when pp > 1

    # ---- communication -------------------------------------------------------------------------
    @property
    def data_group(self) -> dist.ProcessGroup | None:
        if self.mesh is None or self.dims.data_parallel_size == 1:
            return None
        return data_mesh(self.mesh).get_group()

    def data_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a per-rank scalar over the data-parallel (and cp) ranks (gloo has no AVG: sum, divide).

        cp ranks hold equal shares of the same rows' tokens, so the mean of their means is the
        mean over every token of the global batch.
        """
        if self.dims.cp > 1 and self.mesh is not None:
            group, size = data_cp_mesh(self.mesh).get_group(), self.dims.data_parallel_size * self.dims.cp
        else:
            group, size = self.data_group, self.dims.data_parallel_size
        if group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        return value / size

    @property
    def gradient_average_size(self) -> int:
        """How many ranks the data-parallel wrapper averages gradients over (dp x sharding, x cp: cp
        ranks hold the same parameters and different tokens)."""
        return self.dims.data_parallel_size * self.dims.cp

    def data_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank tensor over the data-parallel ranks."""
        group = self.data_group
        if group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        return value

    def loss_context(self):
        if self.loss_parallel:
            return loss_parallel()
        return nullcontext()

    def after_backward(self) -> None:
        """The gradient synchronisation the layout needs beyond its data-parallel wrapper."""
        for hook in self.gradient_hooks:
            hook()

    def param_device(self) -> torch.device:
        """Where this rank's (first) parameter lives."""
        param = next(self.model.parameters())
        return getattr(param, "_local_tensor", param).device

    def input_device(self) -> torch.device:
        """Where batches go (offloaded FSDP keeps sharded params on the CPU, compute on the device)."""
        return self.compute_device or self.param_device()
