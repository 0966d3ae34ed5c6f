"""One optimizer step, for every layout: micro-batches -> loss -> backward -> clip -> optimizer.

`parallelize` (suite.parallel) only places the model: it returns a `Placement` saying what this rank
holds. The step lives here and reads the placement: how a micro-batch becomes model inputs (document
masks, context-parallel chunks), how losses are weighted (the mean of micro-batch means for token
windows; token-weighted over the global batch for labelled SFT rows), when data-parallel wrappers
synchronise gradients, which reductions clipping needs, and how the optimizer skips a non-finite
step. `build_step` is the one constructor: the trainer, finetuning and the benchmarks call it.
A pipeline placement gets `suite.train.pipeline_step.PipelineStep`, which runs the schedule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from suite.parallel import memory
from suite.parallel.parallelize import Placement

LossFn = Callable[..., torch.Tensor]  # (logits, targets, reduction="mean"|"sum") -> scalar loss


def is_labelled(batch) -> bool:
    """A finetuning micro-batch (suite.data.sft.SFTBatch: tokens, labels, positions, doc_ids), as
    opposed to a pretraining token window [b, s+1]."""
    return hasattr(batch, "labels")


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of a (possibly DTensor) scalar loss."""
    loss = loss.detach()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # DTensor (tp > 1)


def training_loss(model: nn.Module, moe: bool) -> LossFn:
    """Cross-entropy over the targets; for an MoE model in training, plus its balance and z-losses,
    which are per-micro-batch means, so only beside a mean loss."""
    from suite.models.moe import moe_aux_loss
    from suite.train.loss import cross_entropy

    def loss_fn(logits, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = cross_entropy(logits, targets, reduction)
        if moe and model.training and reduction == "mean":
            aux = moe_aux_loss(model)
            if aux is not None:
                loss = loss + aux.to(loss.device)
        return loss

    return loss_fn


@dataclass
class StepResult:
    loss: torch.Tensor  # the global-batch loss (detached)
    grad_norm: torch.Tensor  # before clipping
    ok: bool | torch.Tensor  # the update was applied (a device bool when decided on the device)
    spiked: bool = False  # skipped as a loss spike (the caller rolls back)


class TrainStep:
    """Forward/backward over a step's micro-batches, clipping and the optimizer, on one placement.

    `eos_id` (data.doc_mask): positions restart after every EOS and attention stays inside documents.
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
        eos_id: int | None = None,
        loss_chunk_tokens: int = 0,
        spike_detection: bool = False,
        host_group: dist.ProcessGroup | None = None,
    ):
        self.placement = placement
        self.model = placement.model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.autocast = autocast
        self.scaler = scaler
        self.grad_scaler = grad_scaler  # fp16: the scaler skips overflowing steps itself
        self.grad_clip = grad_clip
        self.eos_id = eos_id
        self.loss_chunk_tokens = loss_chunk_tokens
        self.spike_detection = spike_detection
        self.host_group = host_group
        self.state_peaks: dict[str, int] = {}

    # ---- inputs and losses ------------------------------------------------------------------------
    def model_inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(tokens, targets, forward kwargs) of a [b, s + 1] row batch for this rank.

        data.doc_mask: positions restart after every EOS and attention stays inside documents;
        cp > 1: only this rank's two sequence chunks, with their real positions.
        """
        tokens, targets = batch[:, :-1], batch[:, 1:]
        doc_ids = None
        if self.eos_id is not None:
            from suite.data.documents import document_ids

            doc_ids = document_ids(tokens, self.eos_id)
        cp = self.placement.dims.cp
        if cp > 1:
            from suite.parallel.context_parallel import split_batch

            return split_batch(tokens, targets, cp, self.placement.cp_rank, doc_ids)
        if doc_ids is None:
            return tokens, targets, {}
        from suite.data.documents import document_mask, document_positions

        return tokens, targets, {"positions": document_positions(doc_ids), "mask": document_mask(doc_ids)}

    def model_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, kwargs: dict, loss_fn: LossFn
    ) -> torch.Tensor:
        """The model's loss on one micro-batch, as `model_inputs` made it (tokens, targets, forward kwargs).

        With loss_chunk_tokens > 0 and more tokens than that in the batch, the model hands its final
        hidden states and head weight to the loss instead of projecting them (the forward's `head`
        argument), and the loss applies the head chunk by chunk (suite.train.loss.HeadInput), so the
        full logits never exist; one chunk would only add work, so the plain loss runs then. Under
        tensor parallelism the logits are vocab-sharded DTensors and DTensor's loss_parallel already
        avoids gathering them: that path is kept as it is; so is a head that is not a plain nn.Linear
        (LoRA on `output`), whose forward adds more than `hidden @ weight.T`.
        """
        chunk = self.loss_chunk_tokens
        plain_head = type(getattr(self.model, "output", None)) is nn.Linear  # not a LoRA-wrapped head
        if 0 < chunk < targets.numel() and plain_head and not self.placement.loss_parallel:
            from suite.train.loss import HeadInput

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return loss_fn(HeadInput(hidden, weight, chunk), targets)  # type: ignore[arg-type]

            return self.model(tokens, head=head, **kwargs)
        return loss_fn(self.model(tokens, **kwargs), targets)

    # ---- one optimizer step's work ---------------------------------------------------------------
    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns the global-batch mean loss (detached).

        Token batches: the mean of the micro-batches' mean losses. Labelled (finetuning)
        micro-batches: token-weighted (`_labelled_loss`).
        """
        if micro_batches and is_labelled(micro_batches[0]):
            return self._accumulate(micro_batches, *self._labelled_loss(micro_batches))
        count = len(micro_batches)
        return self._accumulate(micro_batches, self.model_inputs, self.loss_fn, lambda loss: loss / count)

    def _labelled_loss(self, micro_batches: list) -> tuple[Callable, LossFn, Callable]:
        """Loss = sum of masked cross-entropy / number of target tokens in the whole global batch.

        Micro-batches and data-parallel ranks hold different numbers of target tokens, so the
        denominator is counted over all of them first (one all-reduce); every micro-batch then
        contributes its loss *sum* over that count, times the data-parallel size because the
        data-parallel wrappers average gradients over the ranks. Any dp / micro-batch split thus
        gives the gradient and loss of one process taking the global batch at once.
        Returns (inputs of a batch, loss function, weighting of a loss) for `_accumulate`.
        """
        placement = self.placement
        local_targets = sum(batch.num_targets for batch in micro_batches)
        targets = placement.data_sum(torch.tensor(float(local_targets), device=placement.input_device()))
        # a device tensor, never read on the host: no synchronisation per step (the same value as the
        # Python division: integers, one correctly rounded float32 quotient)
        scale = placement.dims.data_parallel_size / targets.clamp(min=1.0)
        summed = functools.partial(self.loss_fn, reduction="sum")
        return (
            (lambda batch: (batch.tokens, batch.labels, batch.model_kwargs())),
            summed,
            lambda loss: loss * scale,
        )

    def _accumulate(
        self, micro_batches: list, inputs: Callable, loss_fn: LossFn, weight: Callable
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch's weight(loss); gradients synchronised on the last."""
        placement = self.placement
        device = placement.input_device()
        total = torch.zeros((), device=device)
        count = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == count - 1
            if placement.dp_kind != "none":
                from suite.parallel.data_parallel import set_gradient_sync

                set_gradient_sync(self.model, placement.dp_kind, last)
            tokens, targets, kwargs = inputs(batch.to(device, non_blocking=True))
            with placement.loss_context():
                with self.autocast():
                    loss = weight(self.model_loss(tokens, targets, kwargs, loss_fn))
                if last:
                    self.note_bytes("params", memory.parameter_bytes(self.model))
                self.scaler.scale(loss).backward()
            total += local_value(loss)
        placement.after_backward()
        self.note_bytes("params", memory.parameter_bytes(self.model))
        self.note_bytes("grads", memory.gradient_bytes(self.model))
        return placement.data_mean(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.placement.mesh is None:
            if max_norm > 0:
                return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        from suite.parallel.data_parallel import clip_grad_norm_

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
        for group in self.optimizer.param_groups:
            group["lr"] = lr
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
    def evaluate(self, batches: list) -> float:
        self.model.eval()
        placement = self.placement
        device = placement.input_device()
        if batches and is_labelled(batches[0]):  # token-weighted over every batch and rank
            summed = functools.partial(self.loss_fn, reduction="sum")
            sums = torch.zeros(2, device=device, dtype=torch.float64)
            for batch in batches:
                batch = batch.to(device)
                with placement.loss_context(), self.autocast():
                    loss = self.model_loss(batch.tokens, batch.labels, batch.model_kwargs(), summed)
                    sums[0] += local_value(loss).double()
                sums[1] += batch.num_targets
            sums = placement.data_sum(sums)
            return float(sums[0] / sums[1].clamp(min=1))
        losses = []
        for batch in batches:
            tokens, targets, kwargs = self.model_inputs(batch.to(device))
            with placement.loss_context(), self.autocast():
                losses.append(local_value(self.model_loss(tokens, targets, kwargs, self.loss_fn)).float())
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        return float(placement.data_mean(mean))

    # ---- accounting ------------------------------------------------------------------------------
    def note_bytes(self, kind: str, value: int) -> None:
        self.state_peaks[kind] = max(self.state_peaks.get(kind, 0), value)

    def note_optimizer(self) -> None:
        """Record optimizer-state bytes (after a step, when the state exists)."""
        self.note_bytes("optim", memory.optimizer_bytes(self.optimizer))
        self.note_bytes("params", memory.parameter_bytes(self.model))

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


def build_step(
    placement: Placement,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    autocast: Callable,
    scaler: torch.amp.GradScaler,
    **options,
) -> TrainStep:
    """The step for this placement: the accumulation loop, or the pipeline schedule (pp > 1).
    `options`: TrainStep's keyword arguments."""
    if placement.pipeline is not None:
        from suite.train.pipeline_step import PipelineStep

        return PipelineStep(placement, optimizer, loss_fn, autocast, scaler, **options)
    return TrainStep(placement, optimizer, loss_fn, autocast, scaler, **options)
