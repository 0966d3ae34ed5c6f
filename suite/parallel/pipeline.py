"""Pipeline parallelism: split the layer stack into stages and run them with torch.distributed.pipelining.

    build_pipeline(model, cfg, dims, mesh, device, parallelize_part) -> Placement (pipeline: PipelineStages)

1. The meta-device model's layers are cut into pp*vpp contiguous stages balanced by parameter
   count (the first stage also pays for the token/position embeddings, the last for the final
   norm and the output head). Each stage part is a deep copy of the meta model with the other
   layers deleted: `layers` is a ModuleDict, so a part's parameters keep the plain model's names
   (`layers.5.attention.wq.weight`) and DCP checkpoints move between layouts. Parts without the
   embedding take the previous stage's hidden states; parts without the head return them.
2. `parallelize_part(part)` applies TP / recompute / FSDP and materialises each part.
3. Stage parts are placed "looped": rank r of the pp group holds stages r, r+pp, r+2pp, ...
   (one stage per rank for gpipe and 1f1b, vpp for interleaved_1f1b and zero_bubble).
4. Tied embeddings (gpt): the first stage's embedding and the last stage's output head are two
   copies of one weight. They start equal (the first stage's values are broadcast) and stay equal
   because their gradients are summed across the two stages before the optimizer step
   (Megatron's embedding group), which is exactly the gradient of the shared weight.
5. Multi-token prediction (DeepSeek-V3, suite.models.mtp): the MTP modules sit on the last stage,
   after the last layer, and embed later tokens with the model's embedding, so the last stage also
   holds a copy of `tok_embeddings`, kept equal to the first stage's exactly as a tied head is (the
   same group, broadcast and gradient sum; with tied embeddings the head is that copy). It reads
   the later tokens from the schedule's `mtp_targets` keyword argument (suite.train.pipeline_step).

The schedule's loss is each micro-batch's share of the global-batch loss (summed over its target
tokens, divided by the global batch's; suite.train.step), so the schedule must not divide the
gradients again (scale_grads=False); data-parallel wrappers average across replicas. Positions and
document masks travel as the schedule's keyword arguments, which reach every stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.parallel import data_parallel as dpar
from suite.parallel.dims import MULTI_STAGE, PP_SCHEDULES, ParallelDims
from suite.parallel.mesh import data_rank
from suite.parallel.placement import Placement

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
assert tuple(SCHEDULES) == PP_SCHEDULES  # the names suite.parallel.dims.check_pipeline accepts


# ---- splitting ---------------------------------------------------------------------------------
def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def split_layers(
    layer_costs: list[int], first_extra: int, last_extra: int, num_stages: int
) -> list[list[int]]:
    """Contiguous layer ranges, one per stage (each at least one layer), minimising the largest
    stage cost, where the first stage also costs `first_extra` and the last `last_extra`.
    Ties go to the most even layer counts."""
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ConfigError(
            f"cannot split {n} layers into {num_stages} pipeline stages; use at most {n} stages"
        )
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    even = n / num_stages
    # best[s][i]: (max cost, unevenness) for the first i layers in s+1 stages; cut[s][i]: start of stage s.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(1, n + 1):
        best[0][i] = (cost(0, 0, i), (i - even) ** 2)
    for s in range(1, num_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                prev = best[s - 1][j]
                cand = (max(prev[0], cost(s, j, i)), prev[1] + (i - j - even) ** 2)
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    bounds, hi = [], n
    for s in range(num_stages - 1, 0, -1):
        lo = cut[s][hi]
        bounds.append((lo, hi))
        hi = lo
    bounds.append((0, hi))
    return [list(range(lo, hi)) for lo, hi in reversed(bounds)]


def plan_stages(model: nn.Module, num_stages: int) -> list[list[int]]:
    """Global layer ids of each stage for `model` (a plain Transformer, meta or not)."""
    ids = sorted(int(k) for k in model.layers)
    costs = [_numel(model.layers[str(i)]) for i in ids]
    first = _numel(model.tok_embeddings) + _numel(model.pos_embeddings)
    last = _numel(model.norm) + _numel(model.output)  # a tied head is a separate copy on the last stage
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # the MTP modules, and the embedding they read (the tied head is that copy)
        last += _numel(mtp) + (0 if model.cfg.tie_embeddings else _numel(model.tok_embeddings))
    return [[ids[i] for i in stage] for stage in split_layers(costs, first, last, num_stages)]


def _hidden_input(module: nn.Module, args: tuple, kwargs: dict):
    """Stages after the first receive hidden states positionally: route them to `hidden=`."""
    if args:
        kwargs = {**kwargs, "hidden": args[0]}
        args = (None, *args[1:])
    return args, kwargs


def make_stage_part(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A deep copy of (meta) `model` holding only `layer_ids`, with the embeddings only if `first`
    and norm + head (+ the MTP modules and the token embedding they use) only if `last`. Parameter
    names stay those of the plain model."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for key in list(part.layers):
        if key not in keep:
            del part.layers[key]
    if not last:
        part.norm = None
        part.output = None
        if getattr(part, "mtp", None) is not None:
            part.mtp = None
    if not first:
        if getattr(part, "mtp", None) is None:
            part.tok_embeddings = None
        part.pos_embeddings = None
        part.register_forward_pre_hook(_hidden_input, with_kwargs=True)
    return part


class PipelineModules(nn.Module):
    """This rank's stage parts seen as one module with the plain model's names.

    `named_parameters()`, `state_dict()` and DCP's get_state_dict see `tok_embeddings.weight`,
    `layers.<i>....`, `output.weight` exactly as the single-process model has them, so the trainer's
    optimizer and checkpoint code work unchanged. It shares the parts' submodules; it is not called.

    With tied embeddings, a rank that holds the head but not the embedding also registers the head's
    weight as `tok_embeddings.weight` (as the tied plain model does): its optimizer state is keyed
    like the plain model's, so checkpoints move between pipeline and non-pipeline layouts both ways.
    """

    def __init__(self, parts: list[nn.Module], tied: bool = False):
        super().__init__()
        object.__setattr__(self, "parts", parts)  # not a submodule: its names would add a prefix
        layers: dict[str, nn.Module] = {}
        children: dict[str, nn.Module] = {}
        for part in parts:
            layers.update(part.layers.items())
            for name, child in part._modules.items():
                if child is not None and name != "layers":
                    children.setdefault(name, child)
        if tied and "tok_embeddings" not in children and "output" in children:
            alias = nn.Module()
            alias.weight = children["output"].weight
            children["tok_embeddings"] = alias
        for name in parts[0]._modules:  # the plain model's order: names and parameters list alike
            if name == "layers":
                self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
            elif name in children:
                setattr(self, name, children[name])

    def train(self, mode: bool = True):
        super().train(mode)
        for part in self.parts:
            part.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipeline-parallel model runs through its schedule: use suite.train.step.build_step"
        )


# ---- process groups ----------------------------------------------------------------------------
def _tied_group(mesh: DeviceMesh, pp: int) -> tuple[dist.ProcessGroup | None, int]:
    """The group of the first- and last-stage ranks that share this rank's other coordinates, and
    the global rank of its first-stage member ((None, -1) for ranks in neither)."""
    dim = mesh.mesh_dim_names.index("pp")
    rows = mesh.mesh.movedim(dim, -1).reshape(-1, pp).tolist()
    me = dist.get_rank()
    if pp == 2:
        row = next(r for r in rows if me in r)
        return mesh.get_group("pp"), row[0]
    found: tuple[dist.ProcessGroup | None, int] = (None, -1)
    for row in rows:  # every rank creates every pair's group, in the same order
        group = dist.new_group([row[0], row[-1]])
        if me in (row[0], row[-1]):
            found = (group, row[0])
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of `t` (a DTensor's local shard), for in-place collectives."""
    return t._local_tensor if isinstance(t, DTensor) else t


# ---- what a rank holds -------------------------------------------------------------------------
class PipelineStages:
    """This rank's pipeline stages: the Transformer parts it runs (`parts`, stage indices
    `stage_ids`), their torch.distributed.pipelining `PipelineStage`s, the pp group, and the tied
    embedding's group when the first and last stages share it (a tied head, or the MTP modules'
    embedding copy); `mtp_depths`: the last stage's MTP modules. The schedule that runs them is
    built with the step's loss (suite.train.pipeline_step)."""

    def __init__(
        self,
        *,
        parts: list[nn.Module],
        stage_ids: list[int],
        schedule_name: str,
        n_microbatches: int,
        tied: bool,
        device: torch.device,
        mesh: DeviceMesh,
        pp: int,
        mtp_depths: int = 0,
    ):
        self.parts = parts
        self.mtp_depths = mtp_depths
        self.stage_ids = stage_ids
        self.num_stages = pp * len(parts)
        self.schedule_name = schedule_name
        self.multi_stage = schedule_name in MULTI_STAGE
        self.device = device
        self.n_microbatches = n_microbatches
        self.pp = pp
        self.pp_group = mesh.get_group("pp")
        self.last_rank = dist.get_global_rank(self.pp_group, (self.num_stages - 1) % pp)
        self.has_first = 0 in stage_ids
        self.has_last = self.num_stages - 1 in stage_ids
        self.stages = [
            PipelineStage(part, idx, self.num_stages, device, group=self.pp_group)
            for part, idx in zip(parts, stage_ids)
        ]
        self.tied_group, self.tied_src = _tied_group(mesh, pp) if tied else (None, -1)
        self.tied_param = None
        if self.tied_group is not None:  # the first stage's embedding; the last's copy (head or MTP's)
            holder = parts[0] if self.has_first else parts[-1]
            copy_ = holder.tok_embeddings if holder.tok_embeddings is not None else holder.output
            self.tied_param = copy_.weight

    def schedule(self, loss_fn: Callable):
        """The configured schedule over these stages, with `loss_fn(output, target)` per micro-batch."""
        cls = SCHEDULES[self.schedule_name]
        arg = self.stages if self.multi_stage else self.stages[0]
        return cls(arg, n_microbatches=self.n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def peer(self, stage: int) -> int:
        """The global rank that runs `stage`."""
        return dist.get_global_rank(self.pp_group, stage % self.pp)

    # ---- tied embedding ------------------------------------------------------------------------
    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Make the last stage's head equal to the first stage's embedding (after init)."""
        if self.tied_param is not None:
            dist.broadcast(_local(self.tied_param.data), src=self.tied_src, group=self.tied_group)

    def reduce_tied_grads(self) -> None:
        """Sum the embedding's and the head's gradients: both become the shared weight's gradient."""
        if self.tied_param is None:
            return
        param = self.tied_param
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # e.g. a vocab-parallel embedding's gradient comes back Replicate: lay it out like the
            # head's (local slicing, no communication) so the two stages' shards line up
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(_local(param.grad), group=self.tied_group)


# ---- entry point ---------------------------------------------------------------------------------
def build_pipeline(
    model: nn.Module,
    cfg: SuiteConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    parallelize_part: Callable[[nn.Module], nn.Module],
    param_dtype: torch.dtype = torch.float32,
) -> Placement:
    """Split the meta-device `model` into this rank's stage parts, parallelise and materialise each
    with `parallelize_part`, and describe them as a Placement (`pipeline`: the stages).

    `mesh` is the job's mesh (suite.parallel.mesh.build_mesh: every axis named, `data` flattened).
    """
    pp = dims.pp
    vpp = cfg.parallel.vpp if cfg.parallel.pp_schedule in MULTI_STAGE else 1
    num_stages = pp * vpp
    plan = plan_stages(model, num_stages)
    pp_rank = mesh.get_local_rank("pp")
    stage_ids = [pp_rank + k * pp for k in range(vpp)]  # looped placement
    tied = bool(model.cfg.tie_embeddings) and model.output is not None and model.tok_embeddings is not None
    mtp_depths = len(model.mtp) if getattr(model, "mtp", None) is not None else 0
    parts = []
    for idx in stage_ids:
        part = make_stage_part(model, plan[idx], first=idx == 0, last=idx == num_stages - 1)
        parts.append(parallelize_part(part) or part)
    stages = PipelineStages(
        parts=parts,
        stage_ids=stage_ids,
        schedule_name=cfg.parallel.pp_schedule,
        n_microbatches=dims.accumulation(cfg.parallel),
        tied=tied or mtp_depths > 0,  # the embedding's copy on the last stage: the head, MTP's or both
        device=device,
        mesh=mesh,
        pp=pp,
        mtp_depths=mtp_depths,
    )
    stages.sync_tied_weights()
    return Placement(
        model=PipelineModules(parts, tied),
        dims=dims,
        dp_rank=data_rank(mesh),
        cp_rank=mesh.get_local_rank("cp"),  # each stage's cp attention runs over the cp group
        materialized=True,
        num_params=model.num_params(),
        mesh=mesh,
        loss_parallel=dims.tp > 1,
        param_dtype=param_dtype,
        dp_kind=dpar.data_parallel_kind(dims, cfg.parallel.sharding_stage),
        optim_device=torch.device("cpu") if cfg.parallel.offload else device,
        compute_device=device,
        gradient_hooks=[stages.reduce_tied_grads],
        pipeline=stages,
    )
