"""The step on a pipeline placement: a torch.distributed.pipelining schedule over this rank's stages.

The schedule's loss is each micro-batch's share of the global-batch loss, weighted exactly as the
single-process loop weighs it (TrainStep.loss_weight), so the schedule does not rescale gradients;
data-parallel wrappers average across replicas. Positions and document masks are the schedule's
keyword arguments, split per micro-batch like the tokens and passed to every stage. With context
parallelism (cp > 1) every stage runs the cp attention over its cp group, so the schedule carries
this rank's sequence chunks (tokens, targets, their positions, the rows' document ids) as the
non-pipelined step does; the loss weight and the final loss average over dp x cp like it. The
placement's gradient hooks then sum the tied embedding's two copies (suite.parallel.pipeline).

Mixture-of-Experts stages: the loss exists on the last stage only, but every stage's MoE layers add
their weighted balance + z-losses, 1 / micro-batches each, as in one process. A forward hook on each
stage part takes its layers' aux loss after every training forward. On the last stage the schedule's
loss adds it; on the others `_AttachAux` ties it to the stage output, so the output's backward also
sends d(loss)/d(aux) = 1 / micro-batches into it (Megatron's MoEAuxLossAutoScaler). The logged loss
sums the last stage's losses and every stage's aux losses over the pp group.

Multi-token prediction (suite.models.mtp) runs on the last stage (suite.parallel.pipeline): its
tokens come as the schedule's `mtp_targets` keyword argument (made from the whole rows, cut into
micro-batches like the tokens), and the same hook takes its weighted loss after every training
forward for the schedule's loss to add, 1 / micro-batches each, as one process adds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from suite.data.batch import Batch
from suite.models.moe import moe_aux_loss, moe_modules
from suite.models.mtp import mtp_targets
from suite.parallel import data_parallel as dpar
from suite.parallel import state_bytes
from suite.parallel.pipeline import PipelineStages
from suite.train.step import TrainStep, like_loss, local_value

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _layout(t: torch.Tensor) -> tuple:
    return (
        ("dtensor", t.device_mesh, t.placements, t.device) if isinstance(t, DTensor) else ("plain", t.device)
    )


def with_positions(tokens: torch.Tensor, kwargs: dict) -> dict:
    """The stage kwargs with the tokens' positions (0..s-1 unless given): a later stage cannot count
    them from the hidden states it receives, which sequence parallelism leaves cut into this tp
    rank's slice of the sequence (RoPE tables of that length would not fit the gathered q and k)."""
    if "positions" in kwargs:
        return kwargs
    return {**kwargs, "positions": torch.arange(tokens.shape[1], device=tokens.device)}


class _AttachAux(torch.autograd.Function):
    """Identity on a stage's output whose backward also gives the aux loss the gradient `scale`.
    A copy, not a view: the zero-bubble schedule detaches stage outputs in place."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype, ctx.aux_device = scale, aux.dtype, aux.device
        return output.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad, aux_grad, None


class PipelineStep(TrainStep):
    """TrainStep whose forward/backward runs the configured schedule; clipping reduces the norm over
    the stages too; evaluation sends hidden states stage to stage (any number of batches)."""

    def __init__(self, placement, *args, **kwargs):
        super().__init__(placement, *args, **kwargs)
        self.stages: PipelineStages = placement.pipeline
        self._weight: torch.Tensor | None = None  # the running step's loss weight
        self._inputs: tuple | None = (
            None  # the running step's (tokens, targets, kwargs, rows per micro-batch)
        )
        self.schedule = self.stages.schedule(self._schedule_loss)
        self._aux_weight = 0.0  # 1 / micro-batches of the running step
        self._aux_logged: list[torch.Tensor] = []  # this step's weighted aux losses, not-last parts
        self._last_aux: list[torch.Tensor] = []  # the last stage's (MoE's, MTP's), for the schedule's loss
        self._in_chunk = False  # a schedule's forward_one_chunk runs (not its metadata inference)
        last = self.stages.num_stages - 1
        for stage, part, idx in zip(self.stages.stages, self.stages.parts, self.stages.stage_ids):
            if moe_modules(part) or getattr(part, "mtp", None) is not None:
                part.register_forward_hook(self._aux_hook(idx == last))
                stage.forward_one_chunk = self._chunk_flagged(stage.forward_one_chunk)

    def _chunk_flagged(self, forward_one_chunk):
        """The stage's forward_one_chunk with `_in_chunk` set: the schedule's first step also runs
        each part on placeholder inputs to infer shapes, whose aux losses must not count."""

        def wrapped(*args, **kwargs):
            self._in_chunk = True
            try:
                return forward_one_chunk(*args, **kwargs)
            finally:
                self._in_chunk = False

        return wrapped

    def _aux_hook(self, is_last: bool):
        """A forward hook that routes the part's MoE aux losses into the loss (see the module doc)."""

        def hook(part, args, output):
            mtp, part.mtp_loss = getattr(part, "mtp_loss", None), None  # the last stage's MTP loss
            if not (part.training and torch.is_grad_enabled() and self._aux_weight and self._in_chunk):
                return None
            aux = moe_aux_loss(part)  # also commits the layers' load statistics, once per micro-batch
            if is_last:  # added in one process's order: MoE's, then MTP's
                self._last_aux = [x for x in (aux, mtp) if x is not None]
                return None
            if aux is None:
                return None
            self._aux_logged.append(aux.detach() * self._aux_weight)
            return _AttachAux.apply(output, aux, self._aux_weight * self.scaler.get_scale())

        return hook

    def _micro_batch_inputs(self, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(tokens, kwargs) of the micro-batch whose targets the schedule hands the loss. The schedule
        splits the step's targets into views (torch.tensor_split), so the view's offset in the step's
        targets names its rows; anything else (a copy, another split) is refused, not guessed."""
        tokens, labels, kwargs, rows = self._inputs
        row_bytes = labels.stride(0) * labels.element_size()
        offset, rest = divmod(target.data_ptr() - labels.data_ptr(), row_bytes)
        if rest or offset % rows or target.shape[0] != rows or not 0 <= offset < labels.shape[0]:
            raise RuntimeError(
                "the pipeline schedule handed the loss targets that are not a micro-batch view of the "
                "step's targets; a training method's loss cannot find that micro-batch's tokens"
            )
        mine = slice(offset, offset + rows)
        return tokens[mine], {k: v[mine] for k, v in kwargs.items()}

    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.method_loss is not None:  # a training method's loss (distillation: with the teacher)
            tokens, kwargs = self._micro_batch_inputs(target)
            with self.method_loss.micro_batch(tokens, kwargs) as loss_fn:
                loss = self.scaler.scale(loss_fn(output, target, self._weight))
        else:
            loss = self.scaler.scale(self.loss_fn(output, target, self._weight))
        for aux in self._last_aux:
            loss = loss + self.scaler.scale(like_loss(aux.to(output.device), loss) * self._aux_weight)
        self._last_aux = []
        return loss

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        dist.broadcast(value, src=self.stages.last_rank, group=self.stages.pp_group)
        return value

    def _pp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-stage scalar over the pp group (every stage's share of the loss)."""
        value = value.detach().clone()
        dist.all_reduce(value, group=self.stages.pp_group)
        return value

    def stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`model_inputs` (cp > 1: this rank's sequence chunks) with every tensor batch-major: the
        schedule cuts each keyword argument into micro-batches along dim 0, so the chunks' shared
        positions [2L] are expanded to one row per sample; the last stage's MTP modules also get
        their later tokens (`mtp_targets`, [b, depths + 1, s]); positions always travel with the
        micro-batch (`with_positions`)."""
        tokens, labels, kwargs = self.model_inputs(batch)
        depths = self.stages.mtp_depths
        if depths and self.stages.has_last and "mtp_targets" not in kwargs:  # (cp > 1: its chunks')
            kwargs = {**kwargs, "mtp_targets": mtp_targets(tokens, depths)}
        kwargs = with_positions(tokens, kwargs)
        positions = kwargs["positions"]
        if positions.dim() == 1:
            kwargs = {**kwargs, "positions": positions.expand(tokens.shape[0], -1)}
        return tokens, labels, kwargs

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """One schedule step over the micro-batches; the data-parallel global-batch loss on every rank."""
        stages, placement = self.stages, self.placement
        if len(micro_batches) != stages.n_microbatches:
            raise ValueError(
                f"the pipeline schedule was built for {stages.n_microbatches} micro-batches per step, "
                f"got {len(micro_batches)}"
            )
        weight = self.loss_weight(micro_batches)
        batch = Batch.cat(micro_batches)
        if micro_batches[0].is_pinned():  # keep the copy asynchronous (data.prefetch pins on CUDA)
            batch = batch.pin_memory()
        batch = batch.to(placement.input_device(), non_blocking=True)
        tokens, labels, kwargs = self.stage_inputs(batch)
        scaler = self.scaler
        self._weight = weight
        self._inputs = (tokens, labels, kwargs, labels.shape[0] // len(micro_batches))
        self._aux_weight, self._aux_logged = 1.0 / len(micro_batches), []
        losses: list[torch.Tensor] = []
        args = (tokens,) if stages.has_first else ()
        with placement.loss_context(), self.autocast():  # the last stage's loss backward runs inside step()
            self.schedule.step(
                *args,
                target=labels if stages.has_last else None,
                losses=losses,
                return_outputs=False,
                **kwargs,
            )
        placement.after_backward()
        self.note_bytes("params", state_bytes.parameter_bytes(self.model))
        self.note_bytes("grads", state_bytes.gradient_bytes(self.model))
        if stages.has_last:
            loss = torch.stack([local_value(x).float() for x in losses]).sum()
            if scaler.is_enabled():
                loss = loss / scaler.get_scale()
        else:
            loss = torch.zeros((), device=placement.input_device())
        for aux in self._aux_logged:  # the earlier stages' aux losses (the last's are in `losses`)
            loss = loss + aux.to(loss.device, loss.dtype)
        self._aux_weight, self._aux_logged = 0.0, []
        self._weight = self._inputs = None
        return placement.data_mean(self._pp_sum(loss))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global 2-norm over every stage and shard (a tied weight counted once), then clip."""
        stages = self.stages
        params = [p for p in self.model.parameters() if p.grad is not None]
        counted = [p for p in params if p is not stages.tied_param or stages.has_first]
        total = dpar.total_grad_norm(counted, extra_group=stages.pp_group)
        if max_norm > 0:
            with torch.no_grad():
                groups: dict = {}
                for p in params:
                    groups.setdefault(_layout(p.grad), []).append(p)
                for members in groups.values():
                    torch.nn.utils.clip_grads_with_norm_(
                        members, max_norm, total.to(members[0].grad.device), foreach=True
                    )
        return total

    # ---- evaluation --------------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst_stage: int) -> None:
        if isinstance(t, DTensor):  # the tp plans return local tensors from every block
            raise RuntimeError(
                f"pipeline evaluation sends plain tensors between stages, but stage {dst_stage - 1} produced a "
                f"DTensor ({t.placements}); its last module's tensor-parallel style must use "
                "use_local_output=True (suite.parallel.tensor_parallel.block_plan)"
            )
        header = torch.tensor(
            [t.dim(), *t.shape, _DTYPES.index(t.dtype)] + [0] * (6 - t.dim()), dtype=torch.long
        )
        peer, group = self.stages.peer(dst_stage), self.stages.pp_group
        dist.send(header.to(t.device), dst=peer, group=group)
        dist.send(t.contiguous(), dst=peer, group=group)

    def _recv(self, src_stage: int, device: torch.device) -> torch.Tensor:
        peer, group = self.stages.peer(src_stage), self.stages.pp_group
        header = torch.zeros(8, dtype=torch.long, device=device)
        dist.recv(header, src=peer, group=group)
        ndim = int(header[0])
        shape, dtype = header[1 : 1 + ndim].tolist(), _DTYPES[int(header[1 + ndim])]
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=peer, group=group)
        return t

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """Forward only, batch by batch through the stages (no schedule: any number of batches);
        the loss over every target token of `batches`, on every rank."""
        self.model.eval()
        stages, placement = self.stages, self.placement
        device = placement.input_device()
        by_stage = dict(zip(stages.stage_ids, stages.parts))
        weight = self.loss_weight(batches)
        total = torch.zeros((), device=device, dtype=torch.float64)
        for batch in batches:
            tokens, labels, kwargs = self.model_inputs(batch.to(device))
            kwargs = with_positions(tokens, kwargs)
            hidden = None
            for s in range(stages.num_stages):
                part = by_stage.get(s)
                if part is None:
                    continue
                if s > 0 and (s - 1) not in by_stage:
                    hidden = self._recv(s - 1, device)
                with placement.loss_context(), self.autocast():
                    out = part(tokens, **kwargs) if s == 0 else part(hidden, **kwargs)
                    if s == stages.num_stages - 1:
                        total += local_value(self.loss_fn(out, labels, weight)).double()
                hidden = out
                if s + 1 < stages.num_stages and (s + 1) not in by_stage:
                    self._send(out, s + 1)
        return float(placement.data_mean(self._from_last_stage(total)))
