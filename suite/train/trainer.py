"""The loop of every training method: config -> mesh -> meta model -> parallelize -> loader -> step ->
metrics -> loggers -> atomic checkpoint; at the end report.md (suite.report).

The loop is composed, not extended: a training method (a module with `compose(cfg)`, which its
verb runs) hands it its data and its components (suite.train.components: LoRA, a teacher, ...), and the loop delegates to its parts:
the step (suite.train.step_builder.build_step), checkpoints (suite.train.checkpointing.Checkpointer),
fault handling (suite.train.faults: non-finite steps, spike rollback, SIGTERM), and metrics/logging
(suite.train.loggers). Nothing here names a method.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data.batch import Batch
from suite.models import build_model, flops_per_token, materialize
from suite.parallel.describe import describe_layout
from suite.parallel.dims import ParallelDims
from suite.parallel.env import DistEnv, barrier, init_process_group
from suite.parallel.parallelize import parallelize
from suite.parallel.placement import Placement
from suite.runtime import PrecisionPolicy, pick_device, resolve_precision
from suite.train import checkpoint as ckpt
from suite.train import run_folder
from suite.train.checkpointing import Checkpointer
from suite.train.components import Component, Method, test_components
from suite.train.faults import SIGTERM_EXIT, Preemption, StepFaults
from suite.train.grad_dump import save_gradients
from suite.train.host_memory import apply_host_memory_setting
from suite.train.loggers import MetricsLogger, scrub_secrets, scrub_yaml
from suite.train.loss_scale import loss_scaler
from suite.train.muon import muon_of
from suite.train.optim import optimizer_for
from suite.train.peak_flops import Ceiling, memory_gb, memory_metrics
from suite.train.profile import StepProfiler
from suite.train.schedule import lr_at
from suite.train.standard import standard_components
from suite.train.step import TrainStep, training_loss
from suite.train.step_builder import build_step
from suite.train.tensor_memory import peak_summary, tracked_step

__all__ = ["SIGTERM_EXIT", "Trainer", "autocast_factory", "standalone_step"]


def autocast_factory(device: torch.device, precision: PrecisionPolicy):
    """What each forward runs under: autocast to the precision's dtype over fp32 parameters, or
    nothing when the parameters are already in the compute dtype (train.param_dtype=bf16: the
    weights are not re-cast every step; the loss still runs in fp32, suite.train.loss)."""
    dtype = precision.autocast_dtype
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def standalone_step(cfg: SuiteConfig, dims: ParallelDims, device: torch.device) -> TrainStep:
    """The trainer's step without data, logging or checkpoints, for the benchmarks: the calls of
    `Trainer.__init__` that shape the step, in its order (seed, meta model, parallelize,
    materialise, optimizer, scaler and autocast, `build_step`). Call it as `step(batches, lr)`."""
    apply_host_memory_setting(cfg.train.keep_host_memory, device)
    precision = resolve_precision(cfg.train, device)
    torch.manual_seed(cfg.train.seed)
    placement = parallelize(build_model(cfg.model, "meta"), cfg, dims, device, precision)
    if placement.materialized is False:
        materialize(placement.model, device, cfg.train.seed)
    optimizer = optimizer_for(placement, cfg.optim)
    return build_step(
        placement,
        optimizer,
        training_loss(placement.model, bool(cfg.model.num_experts)),
        autocast_factory(device, precision),
        loss_scaler(device, precision),
        grad_scaler=precision.grad_scaler,
        grad_clip=cfg.optim.grad_clip,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        spike_detection=cfg.train.spike_factor > 0,
    )


class Trainer:
    """One rank's run of a training method: built from the method's data and components (in the
    order: the recipe's standard components, the method's, the tests' own), then `train()`."""

    def __init__(self, cfg: SuiteConfig, dims: ParallelDims, resolved_yaml: str, method: Method):
        self.cfg, self.dims, self.method = cfg, dims, method
        self.verb = method.name
        self.data = method.data
        self.components: list[Component] = [
            *standard_components(cfg),
            *method.components,
            *test_components(cfg),
        ]
        self.public_yaml = scrub_yaml(resolved_yaml)  # what is written to disk: no secrets
        self.env = DistEnv.from_environ()
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        self.device = pick_device(cfg.train.device, self.env)
        self.host_memory_kept = apply_host_memory_setting(cfg.train.keep_host_memory, self.device)
        self.precision = resolve_precision(cfg.train, self.device)  # read here, passed everywhere
        if self.env.is_main and self.precision.emulated:
            print(
                f"warning: train.precision={self.precision.name} on a CPU that does not compute it natively "
                "(bf16: AVX-512 BF16 / AMX; fp16: AVX-512 FP16 / AMX-FP16): "
                "its matmuls are emulated, ~100x slower than fp32 here; train.precision=auto picks fp32",
                file=sys.stderr,
                flush=True,
            )
        init_process_group(self.env, self.device, cfg.launch.backend, cfg.train.collective_timeout_s)
        self.run_dir = Path(cfg.run.dir).expanduser()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.train.seed)

        self.data.prepare(self)
        model = build_model(cfg.model, "meta")
        for component in self.components:
            component.adapt_model(self, model)
        self.placement: Placement = parallelize(model, cfg, dims, self.device, self.precision)
        self.model = self.placement.model
        if self.placement.materialized is False:
            materialize(self.model, self.device, cfg.train.seed)
        for component in self.components:
            component.load_weights(self)
        for component in self.components:
            component.weights_ready(self)
        self.optimizer = optimizer_for(self.placement, cfg.optim, cfg.compress.scale_lr)
        self.scaler = loss_scaler(self.device, self.precision)  # fp16: overflow checked over every rank
        self.autocast = autocast_factory(self.device, self.precision)
        self.loader, self.val_loader = self.data.loaders(self)
        self.step = 0
        self.batch_number = 0  # 1-based number in data order of the batch being trained on
        self.faults = StepFaults(cfg.train)
        self.checkpoints = Checkpointer(self, run_folder.of_run(cfg, self.verb, self.data.data_dir))
        # the per-step SIGTERM check all-reduces a host flag: over gloo when the device is an accelerator
        host_group = None
        if dist.is_initialized() and self.device.type != "cpu":
            host_group = dist.new_group(backend="gloo")
        losses = [loss for loss in (c.step_loss(self) for c in self.components) if loss is not None]
        if len(losses) > 1:
            raise ConfigError(f"{self.verb}: more than one component supplies the training loss")
        self.runner = build_step(
            self.placement,
            self.optimizer,
            training_loss(self.model, bool(cfg.model.num_experts)),  # (a method's: training only)
            self.autocast,
            self.scaler,
            grad_scaler=self.precision.grad_scaler,
            grad_clip=cfg.optim.grad_clip,
            # chunked cross-entropy where the logits are plain tensors; tp > 1 keeps DTensor's loss_parallel
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            spike_detection=cfg.train.spike_factor > 0,
            host_group=host_group,
            method_loss=losses[0] if losses else None,
        )
        if cfg.train.resume:
            self.checkpoints.resume(self)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = Ceiling(self.device, self.precision.name, cfg.train.peak_flops)

    # ---- helpers ------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        if self.env.is_main:
            print(text, flush=True)

    def _gather_floats(self, value: float) -> list[float]:
        """`value` of every rank, in rank order (collective when distributed)."""
        if not dist.is_initialized():
            return [value]
        mine = torch.tensor([value], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return [float(v) for v in every]

    def _layout(self) -> dict:
        """What ran, read off the model (suite.parallel.describe): degrees, data-parallel kind,
        each rank's parameter placements and wrapped modules. Collective when distributed."""
        extra = {"precision": self.precision.name, "param_dtype": self.precision.param_dtype_name}
        if self.dims.pp > 1:
            extra["pp_schedule"] = self.cfg.parallel.pp_schedule
        return describe_layout(self.model, self.dims, self.placement.dp_kind, extra)

    # ---- one step and one evaluation ------------------------------------------------------------
    def train_step(
        self, micro_batches: list[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor, bool]:
        """One optimizer step (suite.train.step: forward/backward, clip, optimizer, the non-finite
        skip) at this step's learning rate. Returns (loss, grad_norm, ok, spiked): a loss spike
        (train.spike_factor) is rolled back by the loop."""
        lr = lr_at(self.step, self.cfg.optim, self.cfg.sched, self.cfg.train.max_steps)
        adjusting = [c for c in self.components if type(c).adjust_loss is not Component.adjust_loss]

        def adjust(loss: torch.Tensor) -> torch.Tensor:
            for component in adjusting:
                loss = component.adjust_loss(self, loss)
            return loss

        result = self.runner(
            micro_batches,
            lr,
            adjust_loss=adjust if adjusting else None,
            before_clip=self._save_gradients if self.step + 1 == self.cfg.train.save_grads_step else None,
            is_spike=self.faults.is_spike if self.cfg.train.spike_factor > 0 else None,
        )
        return result.loss, result.grad_norm, result.ok, result.spiked

    def _save_gradients(self) -> None:
        save_gradients(self.model, self.run_dir, self.step + 1)  # train.save_grads_step

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()  # train.eval_batches x micro_batch_size rows in all, the same ones in any layout
        rows = self.cfg.train.eval_batches * self.cfg.parallel.micro_batch_size
        return self.runner.evaluate(self.val_loader.eval_rows(rows))

    def eval_metrics(self) -> dict:
        """What each evaluation logs: val_loss, then each component's own (a task's accuracy)."""
        metrics = {"val_loss": self.evaluate()}
        for component in self.components:
            metrics |= component.eval_metrics(self)
        return metrics

    def _next_batches(self) -> list[Batch]:
        """The next global batch in data order, passing over batches a spike rollback skipped."""
        while True:
            batches = self.loader.next_step()
            # 1-based number of this batch in data order (batch n is step n's when nothing is skipped)
            self.batch_number = self.loader.epoch * self.loader.steps_per_epoch + self.loader.position
            if self.batch_number not in self.faults.skipped_batches:
                return batches

    # ---- the loop ----------------------------------------------------------------------------
    def _open_logger(self) -> MetricsLogger | None:
        """Rank 0: config.yaml and the run files, then the metrics logger."""
        if not self.env.is_main:
            return None
        cfg = self.cfg
        (self.run_dir / "config.yaml").write_text(self.public_yaml)
        self.data.write_run_files(self)
        for component in self.components:
            component.write_run_files(self)
        config_dict = OmegaConf.to_container(OmegaConf.create(self.public_yaml))
        logger = MetricsLogger(
            self.run_dir, config_dict, cfg.log, cfg.train.max_steps, self.step, self.checkpoints.resumed
        )
        degrees = ", ".join(f"{k}={v}" for k, v in self.dims.enabled.items()) or "single process"
        logger.print(
            f"[bold]suite {self.verb}[/] {cfg.model.name}: {self.placement.num_params / 1e6:.1f}M parameters, "
            f"world {self.env.world_size} ({degrees}), {self.precision.name}, run dir {self.run_dir}"
        )
        return logger

    def _record(self, loss, grad_norm, window_start: float, window_steps: int) -> dict:
        """A logged step's metrics over the window of steps since the last logged one."""
        cfg = self.cfg
        rows = cfg.parallel.global_batch_size * self.method.data.rows_per_sample
        tokens_per_s = rows * cfg.data.seq_len * window_steps
        tokens_per_s /= time.perf_counter() - window_start
        record = {
            "step": self.step,
            "loss": float(loss),
            "lr": lr_at(self.step - 1, cfg.optim, cfg.sched, cfg.train.max_steps),
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "mfu": self.peak.mfu(tokens_per_s, self.flops_per_token, self.env.world_size),
            **memory_metrics(self.device),
            "bad_steps": self.faults.bad_steps,
        }
        if self.precision.grad_scaler:  # fp16: the scale the next step multiplies the loss by
            record["loss_scale"] = self.scaler.get_scale()
        for component in self.components:
            record |= component.log_metrics(self, window_steps)
        return record

    def train(self) -> dict:
        t = self.cfg.train
        logger = self._open_logger()
        last_loss = None
        summary: dict = {}
        profiler = None
        if t.profile:
            profiler = StepProfiler(t, self.run_dir, self.device, self.env.rank, self.log)
        preemption = Preemption()
        try:
            with preemption:
                if self.step == 0 and not self.checkpoints.resumed:
                    metrics = self.eval_metrics()
                    summary |= {f"first_{k}": v for k, v in metrics.items()}
                    if logger:
                        logger.log({"step": 0, **metrics})
                window_start, window_steps = time.perf_counter(), 0
                while self.step < t.max_steps:
                    batches = self._next_batches()
                    for component in self.components:
                        component.before_step(self)
                    loss, grad_norm, ok, spiked = tracked_step(
                        self, batches
                    )  # (train.tensor_memory: the last)
                    for component in self.components:
                        component.after_step(self)
                    if profiler:
                        profiler.step()
                    if spiked:
                        self.faults.rollback(self, loss, logger)
                        continue
                    self.step += 1  # a skipped step still counts: the bad batch is not retried
                    window_steps += 1
                    self.checkpoints.finish_pending(only_if_done=True)  # a finished async save is completed
                    self.faults.record(self, ok, loss, grad_norm, logger)
                    log_now = self.step % t.log_every == 0 or self.step == t.max_steps
                    eval_now = self.step % t.eval_every == 0 or self.step == t.max_steps
                    save_now = self.step % t.save_every == 0 or self.step == t.max_steps
                    if log_now or save_now or self.step % t.eval_every == 0:
                        self.faults.read_flags(self)  # before metrics or a checkpoint count the bad steps
                    record = None
                    if log_now:
                        last_loss = float(loss)
                        record = self._record(loss, grad_norm, window_start, window_steps)
                        window_start, window_steps = time.perf_counter(), 0
                    if eval_now:
                        metrics = self.eval_metrics()
                        summary |= {f"last_{k}": v for k, v in metrics.items()}
                        record = (record or {"step": self.step}) | metrics
                        window_start = time.perf_counter()  # keep eval time out of tokens/s
                    if record and logger:
                        logger.log(record)
                    if logger:
                        logger.advance(self.step, last_loss)
                    saved = None
                    if save_now:
                        saved = self.checkpoints.save(self)
                        if logger and self.checkpoints.pending is None:
                            logger.print(f"saved checkpoint {saved}")
                        elif logger:
                            logger.print(f"writing checkpoint {saved} in the background")
                        window_start = time.perf_counter()
                    if self.step < t.max_steps and preemption.any_rank(self):
                        self.faults.read_flags(self)
                        # preemption (Slurm sends SIGTERM first): checkpoint this step, then leave
                        if saved:
                            saved = self.checkpoints.finish_pending() or saved
                        else:
                            saved = self.checkpoints.save(self, wait=True)
                        if logger:
                            logger.close()
                            logger = None
                        self.log(
                            f"stopped by SIGTERM at step {self.step}; saved checkpoint {saved}; "
                            "run the same command again to resume"
                        )
                        raise SystemExit(SIGTERM_EXIT)
                self.faults.read_flags(self)
                self.checkpoints.finish_pending()  # the last save, when asynchronous
                if logger:
                    logger.finish()  # report.md + plots (rank 0; a failure is a warning, never the run's)
        except KeyboardInterrupt:
            self.checkpoints.finish_quietly()
            if logger:
                logger.close()
                logger = None
            done = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
            where = f"last checkpoint: {done}" if done else "no checkpoint yet"
            self.log(f"interrupted at step {self.step}; {where}; run the same command again to resume")
            raise SystemExit(130) from None
        finally:
            self.checkpoints.finish_quietly()
            if profiler:
                profiler.close()
            if logger:
                logger.close()
        barrier()
        return self._summarise(summary, last_loss)

    def _summarise(self, summary: dict, last_loss: float | None) -> dict:
        """summary.json (rank 0 writes it; collective); each component may add to it afterwards."""
        summary |= {
            "step": self.step,
            "final_loss": last_loss,
            "bad_steps": self.faults.bad_steps,
            "skipped_batches": self.faults.skipped_batches,
            "run_dir": str(self.run_dir),
        }
        summary["state_bytes"] = self.runner.state_bytes()  # params + grads + optimizer state, max over ranks
        summary["mem_gb_per_rank"] = self._gather_floats(memory_gb(self.device))  # peak memory, rank order
        summary |= peak_summary(self)  # train.tensor_memory: the last step's live tensor bytes
        if (muon := muon_of(self.optimizer)) is not None:  # optim=muon: the last step's work, rank order
            summary["muon_per_step"] = {
                k: [int(v) for v in self._gather_floats(n)] for k, n in muon.comm.items()
            }
        summary["layout"] = self._layout()  # what each rank held (collective)
        drawn = self.loader.tokens_by_source()
        if drawn is not None:  # a mixture: the training tokens drawn from each data.sources[i]
            summary["tokens_by_source"] = drawn
        if self.env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(scrub_secrets(summary), indent=1))
            print(
                f"wrote {self.run_dir}/ (config.yaml, metrics.jsonl, checkpoints/, summary.json)", flush=True
            )
        for component in self.components:
            component.finish(self, summary)
        return summary
