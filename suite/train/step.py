"""One optimizer step, for every layout: micro-batches -> loss -> backward -> clip -> optimizer.

`parallelize` (suite.parallel) only places the model: it returns a `Placement` saying what this rank
holds. The step lives here and reads the placement: how a micro-batch (suite.data.batch.Batch, the
one type pretraining and SFT share) becomes model inputs (positions, document masks, context-parallel
chunks), how the loss is weighted (one loss: summed cross-entropy over the target tokens of the whole
global batch, every micro-batch and rank), when data-parallel wrappers synchronise gradients, which
reductions clipping needs, and how the optimizer skips a non-finite step. `build_step` (suite.train.step_builder) is the one constructor: the trainer, every training method
and the benchmarks call it. A pipeline placement gets `suite.train.pipeline_step.PipelineStep`, which
runs the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from suite.data.batch import Batch
from suite.models.moe import moe_aux_loss
from suite.parallel import state_bytes
from suite.parallel.context_parallel import split_batch
from suite.parallel.data_parallel import clip_grad_norm_, set_gradient_sync
from suite.parallel.placement import Placement
from suite.train.loss import HeadInput, cross_entropy

LossFn = Callable[..., torch.Tensor]  # (logits, targets, weight, aux_weight=0.0) -> weighted scalar loss


class MethodLoss(Protocol):
    """A training method's loss in training, where it needs more than the student's logits
    (distillation: the frozen teacher's outputs; a reference model or a reward alike); evaluation
    keeps the step's plain `loss_fn`. The step enters `micro_batch(tokens, kwargs)` for each training
    micro-batch, where its tokens are known, and calls the loss function it yields as
    `(output, targets, weight, aux_weight=0.0)`: `output` is a `HeadInput` (final hidden states and
    head weight) in the accumulation step, the last stage's logits in the pipeline schedule (which
    adds the MoE aux losses itself and passes no aux_weight)."""

    def micro_batch(self, tokens: torch.Tensor, kwargs: dict) -> AbstractContextManager[LossFn]: ...


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of a (possibly DTensor) scalar loss."""
    loss = loss.detach()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # DTensor (tp > 1)


def training_loss(model: nn.Module, moe: bool) -> LossFn:
    """Summed cross-entropy over the targets times `weight` (the step's share of the global batch);
    for an MoE model in training, plus `aux_weight` times its balance and z-losses, and with
    multi-token prediction its weighted MTP loss (per-micro-batch means: the step weighs them
    1 / micro-batches)."""
    mtp = getattr(model, "mtp", None) is not None

    def loss_fn(logits, targets: torch.Tensor, weight, aux_weight: float = 0.0) -> torch.Tensor:
        loss = cross_entropy(logits, targets, "sum") * weight
        if moe and model.training and aux_weight:
            aux = moe_aux_loss(model)
            if aux is not None:
                loss = loss + like_loss(aux.to(loss.device), loss) * aux_weight
        if mtp and model.training and aux_weight and model.mtp_loss is not None:  # suite.models.mtp
            loss = loss + like_loss(model.mtp_loss.to(loss.device), loss) * aux_weight
            model.mtp_loss = None
        return loss

    return loss_fn


def like_loss(aux: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """The aux loss as the loss's kind of tensor: under tp the loss is a DTensor (loss_parallel) and
    the aux loss a plain scalar that every tp rank computed whole (replicated routing)."""
    if not hasattr(loss, "device_mesh") or hasattr(aux, "device_mesh"):  # already a DTensor: MTP's
        return aux
    mesh = loss.device_mesh
    return DTensor.from_local(aux, mesh, [Replicate()] * mesh.ndim, run_check=False)


@dataclass
class StepResult:
    loss: torch.Tensor  # the global-batch loss (detached)
    grad_norm: torch.Tensor  # before clipping
    ok: bool | torch.Tensor  # the update was applied (a device bool when decided on the device)
    spiked: bool = False  # skipped as a loss spike (the caller rolls back)


class TrainStep:
    """Forward/backward over a step's micro-batches, clipping and the optimizer, on one placement.

    `loss_chunk_tokens` (train.loss_chunk_tokens): the head and loss run chunk by chunk.
    """

    def __init__(
        self,
        placement: Placement,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        autocast: Callable,
        scaler: torch.amp.GradScaler,
        *,
        grad_scaler: bool = False,
        grad_clip: float = 1.0,
        loss_chunk_tokens: int = 0,
        spike_detection: bool = False,
        host_group: dist.ProcessGroup | None = None,
        method_loss: MethodLoss | None = None,
    ):
        self.placement = placement
        self.model = placement.model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.autocast = autocast
        self.scaler = scaler
        self.grad_scaler = grad_scaler  # fp16: the scaler skips overflowing steps itself
        self.grad_clip = grad_clip
        self.loss_chunk_tokens = loss_chunk_tokens
        self.spike_detection = spike_detection
        self.host_group = host_group
        self.method_loss = method_loss  # the training method's loss (distillation's teacher), or None
        self.state_peaks: dict[str, int] = {}

    # ---- inputs and losses ------------------------------------------------------------------------
    def model_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(tokens, targets, forward kwargs) of a micro-batch for this rank (cp > 1: only this rank's
        two sequence chunks, with their own positions and document mask)."""
        cp = self.placement.dims.cp
        if cp > 1:
            mtp = getattr(self.model, "mtp", None)  # multi-token prediction: whole rows' later tokens
            return split_batch(batch, cp, self.placement.cp_rank, len(mtp) if mtp is not None else 0)
        return batch.tokens, batch.labels, batch.model_kwargs()

    def loss_weight(self, micro_batches: list[Batch]) -> torch.Tensor:
        """The factor that turns a micro-batch's summed loss into its share of the global-batch loss.

        Micro-batches and data-parallel ranks may hold different numbers of target tokens (SFT), so
        the denominator is counted over all of them first (one all-reduce, a device tensor never read
        on the host); times the ranks the data-parallel wrapper averages gradients over. Any dp / cp /
        micro-batch split thus gives the loss and gradient of one process taking the global batch at once.
        """
        placement = self.placement
        local = float(sum(batch.num_targets for batch in micro_batches))
        targets = placement.data_sum(torch.tensor(local, device=placement.input_device()))
        return placement.gradient_average_size / targets.clamp(min=1.0)

    def model_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, kwargs: dict, weight, aux_weight: float = 0.0
    ) -> torch.Tensor:
        """The model's weighted loss on one micro-batch, as `model_inputs` made it (tokens, targets, kwargs).

        With loss_chunk_tokens > 0 and more tokens than that in the batch, the model hands its final
        hidden states and head weight to the loss instead of projecting them (the forward's `head`
        argument), and the loss applies the head chunk by chunk (suite.train.loss.HeadInput), so the
        full logits never exist; one chunk would only add work, so the plain loss runs then. Under
        tensor parallelism the logits are vocab-sharded DTensors and DTensor's loss_parallel already
        avoids gathering them: that path is kept as it is; so is a head that is not a plain nn.Linear
        (LoRA on `output`), whose forward adds more than `hidden @ weight.T`.
        A training method's loss (`method_loss`) always gets the head's input, in training.
        """
        chunk = self.loss_chunk_tokens
        if self.method_loss is not None and self.model.training:
            with self.method_loss.micro_batch(tokens, kwargs) as method_fn:

                def method_head(hidden: torch.Tensor, weight_: torch.Tensor) -> torch.Tensor:
                    return method_fn(HeadInput(hidden, weight_, chunk), targets, weight, aux_weight)

                return self.model(tokens, head=method_head, **kwargs)
        plain_head = type(getattr(self.model, "output", None)) is nn.Linear  # not a LoRA-wrapped head
        if 0 < chunk < targets.numel() and plain_head and not self.placement.loss_parallel:

            def head(hidden: torch.Tensor, weight_: torch.Tensor) -> torch.Tensor:
                return self.loss_fn(HeadInput(hidden, weight_, chunk), targets, weight, aux_weight)  # type: ignore[arg-type]

            return self.model(tokens, head=head, **kwargs)
        return self.loss_fn(self.model(tokens, **kwargs), targets, weight, aux_weight)

    # ---- one optimizer step's work ---------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward and backward of each micro-batch's share of the global-batch loss; gradients
        synchronised on the last. Returns the global-batch loss (detached)."""
        placement = self.placement
        device = placement.input_device()
        weight = self.loss_weight(micro_batches)
        total = torch.zeros((), device=device)
        count = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == count - 1
            if placement.dp_kind != "none":
                set_gradient_sync(self.model, placement.dp_kind, last)
            tokens, targets, kwargs = self.model_inputs(batch.to(device, non_blocking=True))
            with placement.loss_context():
                with self.autocast():
                    loss = self.model_loss(tokens, targets, kwargs, weight, 1.0 / count)
                if last:
                    self.note_bytes("params", state_bytes.parameter_bytes(self.model))
                self.scaler.scale(loss).backward()
            total += local_value(loss)
        placement.after_backward()
        self.note_bytes("params", state_bytes.parameter_bytes(self.model))
        self.note_bytes("grads", state_bytes.gradient_bytes(self.model))
        return placement.data_mean(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.placement.mesh is None and all(p.grad.dtype == torch.float32 for p in params):
            if max_norm > 0:
                return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return clip_grad_norm_(params, max_norm)

    def __call__(
        self,
        micro_batches: list,
        lr: float,
        *,
        adjust_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        before_clip: Callable[[], None] | None = None,
        is_spike: Callable[[float], bool] | None = None,
    ) -> StepResult:
        """Forward/backward over the micro-batches, clip, optimizer step.

        A non-finite loss or gradient norm (ok false) skips the optimizer step: gradients are zeroed,
        nothing is updated. Every rank decides alike (loss and norm are global; the flag is all-reduced).
        With fp16 the grad scaler already skips overflowing steps, so only the loss counts there.

        Where the optimizer can skip on the device (fused AdamW's `found_inf`), the decision never
        leaves the device: `ok` is then a bool tensor that the caller reads at its logging steps, so a
        step costs no host-device synchronisation. Spike detection (`is_spike`, train.spike_factor)
        and fp16 read the loss every step, as they must decide on the host.
        `adjust_loss` (fault injection in tests) and `before_clip` (train.save_grads_step) are the
        trainer's hooks.
        """
        self.model.train()
        for (
            group
        ) in self.optimizer.param_groups:  # lr_ratio: learned quantization scales (optim.param_groups)
            group["lr"] = lr * group.get("lr_ratio", 1.0)
        loss = self.forward_backward(micro_batches)
        if adjust_loss is not None:
            loss = adjust_loss(loss)
        self.scaler.unscale_(self.optimizer)
        if before_clip is not None:
            before_clip()
        grad_norm = self.clip_grad_norm(self.grad_clip)
        if self.skips_on_device():
            bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            if dist.is_initialized():  # any rank's non-finite step is every rank's (no host read)
                bad = bad.to(self.placement.input_device(), torch.float32)
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            found_inf = bad.to(self.placement.input_device(), torch.float32).reshape(())
            self.optimizer.found_inf, self.optimizer.grad_scale = found_inf, None
            try:
                self.optimizer.step()  # fused AdamW leaves parameters and state alone when found_inf
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale
            self.note_optimizer()
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss, grad_norm, found_inf == 0)
        finite = math.isfinite(float(loss))
        if not self.grad_scaler:
            finite = finite and math.isfinite(float(grad_norm))
        spike = finite and is_spike is not None and is_spike(float(loss))
        not_finite, spiked = self.any_ranks(not finite, spike)
        ok = not not_finite and not spiked
        if ok:
            self.scaler.step(self.optimizer)
            self.note_optimizer()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, ok, spiked)

    def skips_on_device(self) -> bool:
        """The non-finite skip can stay on the device: a fused torch Adam/AdamW (it honours
        `found_inf`), no fp16 grad scaler and no spike detection (both need the loss on the host)."""
        opt = self.optimizer
        return (
            isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
            and all(group.get("fused") for group in opt.param_groups)
            and not self.grad_scaler
            and not self.spike_detection
        )

    def any_ranks(self, *flags: bool) -> list[bool]:
        """Each flag made true on every rank when it is true on any rank (one all-reduce)."""
        if not dist.is_initialized():
            return list(flags)
        # host flags travel over a gloo group on accelerators: no device synchronisation per step
        group = self.host_group
        device = "cpu" if group else self.placement.input_device()
        values = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return [bool(v > 0) for v in values.tolist()]

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """The loss over every target token of `batches` (all ranks' parts), as training weighs it."""
        self.model.eval()
        placement = self.placement
        device = placement.input_device()
        weight = self.loss_weight(batches)
        total = torch.zeros((), device=device, dtype=torch.float64)
        for batch in batches:
            tokens, targets, kwargs = self.model_inputs(batch.to(device))
            with placement.loss_context(), self.autocast():
                total += local_value(self.model_loss(tokens, targets, kwargs, weight)).double()
        return float(placement.data_mean(total))

    # ---- accounting ------------------------------------------------------------------------------
    def note_bytes(self, kind: str, value: int) -> None:
        self.state_peaks[kind] = max(self.state_peaks.get(kind, 0), value)

    def note_optimizer(self) -> None:
        """Record optimizer-state bytes (after a step, when the state exists)."""
        self.note_bytes("optim", state_bytes.optimizer_bytes(self.optimizer))
        self.note_bytes("params", state_bytes.parameter_bytes(self.model))

    def state_bytes(self) -> dict[str, int]:
        """Peak bytes of parameters, gradients and optimizer state this rank held during a step.

        Collective when distributed: the maximum over ranks, so rank 0 can report it.
        """
        keys = ("params", "grads", "optim")
        values = torch.tensor([float(self.state_peaks.get(k, 0)) for k in keys], dtype=torch.float64)
        if self.placement.mesh is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = {k: int(v) for k, v in zip(keys, values.tolist())}
        out["total"] = sum(out.values())
        return out
