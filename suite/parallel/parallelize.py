"""`parallelize`: the one place where a plain model becomes a parallel one.

It returns a ParallelModel, which owns how a step's micro-batches run (plain loop, or a pipeline
schedule), how gradients are clipped (norms across shards and stages), how evaluation runs and
which optimizer wraps the parameters, so the trainer's loop reads the same for every layout.

Order of application (each step sees the previous one's result; the model starts on `meta`):

    1. tensor parallel (+ sequence parallel)   DTensor plans, suite.parallel.tensor_parallel
       context parallel                        cp-aware attention, suite.parallel.context_parallel
    2. activation recompute                    suite.parallel.recompute.apply_recompute
    3. torch.compile per block                 train.compile (in place: names stay the same)
    4. data parallel                           replicate / ZeRO-1 / FSDP2 stage 2-3 / HSDP (+offload)
    5. materialise                             allocate shards, seeded init = the one-process values
   (pp > 1: suite.parallel.pipeline.build_pipeline first cuts the model into this rank's stage
    part(s) and runs 1-5 on each part through the `parallelize_part` callback.)

TP comes first because FSDP shards the TP-local tensors (2-D DTensors); recompute and compile wrap
the TP-rewritten blocks; FSDP is last among the rewrites so its hooks sit outside the recomputed
and compiled regions and gather the parameters once per block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import OptimConfig, SuiteConfig
from suite.parallel import memory
from suite.parallel.dims import ParallelDims
from suite.runtime import PrecisionPolicy

LossFn = Callable[..., torch.Tensor]  # (logits, targets, reduction="mean"|"sum") -> scalar loss


def is_labelled(batch) -> bool:
    """A finetuning micro-batch (suite.data.sft.SFTBatch: tokens, labels, positions, doc_ids), as
    opposed to a pretraining token window [b, s+1]."""
    return hasattr(batch, "labels")


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of a (possibly DTensor) scalar loss."""
    loss = loss.detach()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # DTensor (tp > 1)


@dataclass
class ParallelModel:
    """The model as this rank runs it, plus how to run a step on it.

    Single process: `mesh` is None and every method is the plain PyTorch loop. Distributed: the
    mesh names the axes; `data_group` averages the logged loss; `loss_parallel` runs the loss (and
    its backward) under DTensor's vocab-parallel cross-entropy; `dp_kind` says which data-parallel
    wrapper is on the model (none, replicate, zero1, fsdp, hsdp).
    Subclasses (the pipeline) override forward_backward / evaluate / clip_grad_norm.
    """

    model: nn.Module
    dims: ParallelDims
    dp_rank: int = 0
    materialized: bool = False
    num_params: int = 0
    extras: dict = field(default_factory=dict)
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh when distributed
    loss_parallel: bool = False
    dp_kind: str = "none"
    optim_device: torch.device | None = None
    cp_rank: int = 0  # this rank's coordinate on the cp axis (which sequence chunks it holds)
    eos_id: int | None = None  # data.doc_mask: the document separator (set by the trainer)
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens (set by the trainer); 0: plain logits
    param_dtype: torch.dtype = (
        torch.float32
    )  # train.param_dtype without data parallelism (bf16: fp32 masters)

    # ---- communication helpers -----------------------------------------------------------------
    @property
    def data_group(self) -> dist.ProcessGroup | None:
        if self.mesh is None or self.dims.data_parallel_size == 1:
            return None
        from suite.parallel.mesh import data_mesh

        return data_mesh(self.mesh).get_group()

    def data_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a per-rank scalar over the data-parallel (and cp) ranks (gloo has no AVG: sum, divide).

        cp ranks hold equal shares of the same rows' tokens, so the mean of their means is the
        mean over every token of the global batch.
        """
        if self.dims.cp > 1 and self.mesh is not None:
            from suite.parallel.mesh import data_cp_mesh

            group, size = data_cp_mesh(self.mesh).get_group(), self.dims.data_parallel_size * self.dims.cp
        else:
            group, size = self.data_group, self.dims.data_parallel_size
        if group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        return value / size

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
        if self.dims.cp > 1:
            from suite.parallel.context_parallel import split_batch

            return split_batch(tokens, targets, self.dims.cp, self.cp_rank, doc_ids)
        if doc_ids is None:
            return tokens, targets, {}
        from suite.data.documents import document_mask, document_positions

        return tokens, targets, {"positions": document_positions(doc_ids), "mask": document_mask(doc_ids)}

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
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

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
        if 0 < chunk < targets.numel() and plain_head and not self.loss_parallel:
            from suite.train.loss import HeadInput

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return loss_fn(HeadInput(hidden, weight, chunk), targets)  # type: ignore[arg-type]

            return self.model(tokens, head=head, **kwargs)
        return loss_fn(self.model(tokens, **kwargs), targets)

    def _device(self) -> torch.device:
        param = next(self.model.parameters())
        return getattr(param, "_local_tensor", param).device

    def input_device(self) -> torch.device:
        """Where batches go (offloaded FSDP keeps sharded params on the CPU, compute on the device)."""
        return self.extras.get("compute_device") or self._device()

    # ---- one optimizer step's work -------------------------------------------------------------
    def forward_backward(
        self, micro_batches: list[torch.Tensor], loss_fn: LossFn, autocast, scaler
    ) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns the global-batch mean loss (detached).

        Token batches: the mean of the micro-batches' mean losses. Labelled (finetuning)
        micro-batches: token-weighted (`_labelled_loss`).
        """
        if micro_batches and is_labelled(micro_batches[0]):
            return self._accumulate(
                micro_batches, *self._labelled_loss(micro_batches, loss_fn), autocast, scaler
            )
        count = len(micro_batches)
        return self._accumulate(
            micro_batches, self.model_inputs, loss_fn, lambda loss: loss / count, autocast, scaler
        )

    def _labelled_loss(self, micro_batches: list, loss_fn: LossFn) -> tuple[Callable, LossFn, Callable]:
        """Loss = sum of masked cross-entropy / number of target tokens in the whole global batch.

        Micro-batches and data-parallel ranks hold different numbers of target tokens, so the
        denominator is counted over all of them first (one all-reduce); every micro-batch then
        contributes its loss *sum* over that count, times the data-parallel size because the
        data-parallel wrappers average gradients over the ranks. Any dp / micro-batch split thus
        gives the gradient and loss of one process taking the global batch at once.
        Returns (inputs of a batch, loss function, weighting of a loss) for `_accumulate`.
        """
        local_targets = sum(batch.num_targets for batch in micro_batches)
        targets = self.data_sum(torch.tensor(float(local_targets), device=self.input_device()))
        # a device tensor, never read on the host: no synchronisation per step (the same value as the
        # Python division: integers, one correctly rounded float32 quotient)
        scale = self.dims.data_parallel_size / targets.clamp(min=1.0)
        summed = functools.partial(loss_fn, reduction="sum")
        return (
            (lambda batch: (batch.tokens, batch.labels, batch.model_kwargs())),
            summed,
            lambda loss: loss * scale,
        )

    def _accumulate(
        self, micro_batches: list, inputs: Callable, loss_fn: LossFn, weight: Callable, autocast, scaler
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch's weight(loss); gradients synchronised on the last."""
        device = self.input_device()
        total = torch.zeros((), device=device)
        count = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == count - 1
            if self.dp_kind != "none":
                from suite.parallel.data_parallel import set_gradient_sync

                set_gradient_sync(self.model, self.dp_kind, last)
            tokens, targets, kwargs = inputs(batch.to(device, non_blocking=True))
            with self.loss_context():
                with autocast():
                    loss = weight(self.model_loss(tokens, targets, kwargs, loss_fn))
                if last:
                    self._note_bytes("params", memory.parameter_bytes(self.model))
                scaler.scale(loss).backward()
            total += _local_value(loss)
        if "after_backward" in self.extras:  # expert parallel: reduce expert gradients over their replicas
            self.extras["after_backward"]()
        self._note_bytes("params", memory.parameter_bytes(self.model))
        self._note_bytes("grads", memory.gradient_bytes(self.model))
        return self.data_mean(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.mesh is None:
            if max_norm > 0:
                return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        from suite.parallel.data_parallel import clip_grad_norm_

        return clip_grad_norm_(params, max_norm)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor], loss_fn: LossFn, autocast) -> float:
        device = self.input_device()
        if batches and is_labelled(batches[0]):  # token-weighted over every batch and rank
            summed = functools.partial(loss_fn, reduction="sum")
            sums = torch.zeros(2, device=device, dtype=torch.float64)
            for batch in batches:
                batch = batch.to(device)
                with self.loss_context(), autocast():
                    loss = self.model_loss(batch.tokens, batch.labels, batch.model_kwargs(), summed)
                    sums[0] += _local_value(loss).double()
                sums[1] += batch.num_targets
            sums = self.data_sum(sums)
            return float(sums[0] / sums[1].clamp(min=1))
        losses = []
        for batch in batches:
            tokens, targets, kwargs = self.model_inputs(batch.to(device))
            with self.loss_context(), autocast():
                losses.append(_local_value(self.model_loss(tokens, targets, kwargs, loss_fn)).float())
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        return float(self.data_mean(mean))

    # ---- optimizer and accounting --------------------------------------------------------------
    def build_optimizer(self, cfg: OptimConfig) -> torch.optim.Optimizer:
        """AdamW over this rank's parameters (ZeRO-1: over its slice of them)."""
        from suite.train.optim import build_optimizer

        device = self.optim_device or self._device()
        # with data parallelism FSDP2's MixedPrecisionPolicy keeps the fp32 masters (data_parallel.py)
        param_dtype = self.param_dtype if self.dp_kind == "none" else torch.float32
        optimizer = build_optimizer(self.model, cfg, device, param_dtype)
        if self.dp_kind == "zero1":
            from suite.parallel.data_parallel import ZeroOneOptimizer

            return ZeroOneOptimizer(self.model, optimizer, self.mesh)  # type: ignore[return-value]
        return optimizer

    def _note_bytes(self, kind: str, value: int) -> None:
        peaks = self.extras.setdefault("state_bytes", {})
        peaks[kind] = max(peaks.get(kind, 0), value)

    def note_optimizer(self, optimizer) -> None:
        """Record optimizer-state bytes (call after a step, when the state exists)."""
        self._note_bytes("optim", memory.optimizer_bytes(optimizer))
        self._note_bytes("params", memory.parameter_bytes(self.model))

    def state_bytes(self) -> dict[str, int]:
        """Peak bytes of parameters, gradients and optimizer state this rank held during a step.

        Collective when distributed: the maximum over ranks, so rank 0 can report it.
        """
        peaks = dict(self.extras.get("state_bytes", {}))
        keys = ("params", "grads", "optim")
        values = torch.tensor([float(peaks.get(k, 0)) for k in keys], dtype=torch.float64)
        if self.mesh is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = {k: int(v) for k, v in zip(keys, values.tolist())}
        out["total"] = sum(out.values())
        return out


def _apply_recompute(model: nn.Module, cfg: SuiteConfig) -> None:
    try:
        from suite.parallel.recompute import apply_recompute
    except ImportError:  # pragma: no cover - the recompute module lands separately
        if cfg.recompute.granularity != "none":
            raise ConfigError(
                f"recompute.granularity={cfg.recompute.granularity} is not available in this build; "
                "use recompute=none"
            ) from None
        return
    apply_recompute(model, cfg.recompute)


# train.compile=auto: the smallest width where compiling paid (docs/performance.md)
COMPILE_AUTO_MIN_HIDDEN = 512


def compile_enabled(
    cfg: SuiteConfig, dims: ParallelDims, device: torch.device, precision: PrecisionPolicy
) -> bool:
    """train.compile: true / false as set; `auto` compiles each block where it paid when measured
    (docs/performance.md): Llama-family blocks (RMSNorm, RoPE, SwiGLU: elementwise work that the
    compiled block fuses) at width >= COMPILE_AUTO_MIN_HIDDEN: on CPU in any precision (bf16: -16%
    time; fp32: even time, -20% peak memory), on GPUs in bf16 or fp16. GPT blocks measured no faster
    compiled on CPU, and small models stay eager: a minute of compilation per process outweighs what
    fusing saves there. Never under context parallelism or the zero-bubble pipeline
    schedule, which compiled blocks do not support (true is rejected there)."""
    value = cfg.train.compile
    if value != "auto":
        return bool(value)
    if dims.cp > 1 or (dims.pp > 1 and cfg.parallel.pp_schedule == "zero_bubble"):
        return False
    low_precision = precision.low_precision
    return (
        cfg.model.family == "llama"
        and cfg.model.hidden_size >= COMPILE_AUTO_MIN_HIDDEN
        and (device.type == "cpu" or (device.type == "cuda" and low_precision))
    )


def _compile_blocks(model: nn.Module) -> None:
    for block in model.layers.values():
        block.compile()  # in place: parameter names (and so checkpoints) stay the same


def make_part_parallelizer(
    cfg: SuiteConfig, dims: ParallelDims, mesh, device: torch.device, precision: PrecisionPolicy
) -> tuple[Callable[[nn.Module], nn.Module], dict]:
    """The callback that turns one meta-device model part into this rank's runnable, initialised part.

    Returns (callback, info); info gets `dp_kind`, `optim_device` and `compute_device` once the
    callback has run (the same for every part).
    """
    from suite.parallel import data_parallel as dpar

    info: dict = {}
    pcfg = cfg.parallel

    def parallelize_part(part: nn.Module) -> nn.Module:
        if dims.tp > 1:
            from suite.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(part, mesh["tp"], pcfg.sp)
        if dims.cp > 1:
            from suite.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(part, mesh["cp"])
        expert_params: list = []
        if dims.ep > 1:
            from suite.parallel import expert_parallel as ep

            ep_mesh = ep.build_expert_mesh(dims, device.type)
            expert_params = ep.apply_expert_parallel(
                part, ep_mesh, info.setdefault("ep_traffic", {"bytes": 0})
            )
            info["after_backward"] = lambda: ep.reduce_expert_grads(
                ep.expert_params_of(part), ep_mesh, dims.data_parallel_size
            )
        _apply_recompute(part, cfg)
        if compile_enabled(cfg, dims, device, precision):
            _compile_blocks(part)
        kind = dpar.apply_data_parallel(
            part,
            mesh,
            dims,
            pcfg.sharding_stage,
            precision,
            pcfg.offload,
            device,
            ignored_params=set(expert_params),
            forward_prefetch=pcfg.fsdp_forward_prefetch,
            backward_prefetch=pcfg.fsdp_backward_prefetch,
        )
        # offloaded FSDP keeps the sharded parameters (and so the optimizer) on the CPU
        home = torch.device("cpu") if pcfg.offload else device
        dpar.materialize_parallel(part, home, cfg.train.seed, buffer_device=device)
        if kind == "none" and dims.tp > 1:  # after materialising: hooks live on the final parameters
            from suite.parallel.tensor_parallel import keep_gradient_layouts

            keep_gradient_layouts(part)
        info.update(dp_kind=kind, optim_device=home, compute_device=device)
        return part

    return parallelize_part, info


def parallelize(
    model: nn.Module, cfg: SuiteConfig, dims: ParallelDims, device: torch.device, precision: PrecisionPolicy
) -> ParallelModel:
    """Apply the recipe's parallelism to a meta-device model (see the module docstring for the order)."""
    num_params = model.num_params()
    if dims.world_size == 1:
        _apply_recompute(model, cfg)
        if compile_enabled(cfg, dims, device, precision):
            _compile_blocks(model)
        return ParallelModel(model=model, dims=dims, num_params=num_params, param_dtype=precision.param_dtype)

    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        got = dist.get_world_size() if dist.is_initialized() else 1
        raise ConfigError(
            f"this job has {got} processes but the config asks for {dims.world_size} "
            "(launch.nnodes x launch.nproc_per_node); start it with `suite pretrain ... launch.nproc_per_node=N` "
            "or make the launch keys match torchrun's"
        )
    mesh = dims.build_mesh(device.type)
    parallelize_part, info = make_part_parallelizer(cfg, dims, mesh, device, precision)
    if dims.pp > 1:
        from suite.parallel.pipeline import build_pipeline

        return build_pipeline(model, cfg, dims, mesh, device, parallelize_part)
    model = parallelize_part(model)
    from suite.parallel.mesh import data_rank

    return ParallelModel(
        model=model,
        dims=dims,
        dp_rank=data_rank(mesh),
        cp_rank=mesh.get_local_rank("cp"),
        materialized=True,
        num_params=num_params,
        mesh=mesh,
        loss_parallel=dims.tp > 1,
        dp_kind=info["dp_kind"],
        optim_device=info["optim_device"],
        extras={"compute_device": info["compute_device"]}
        | {k: info[k] for k in ("ep_traffic", "after_backward") if k in info},
    )
