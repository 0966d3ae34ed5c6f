"""The loop of pretraining, finetuning, distillation: config -> mesh -> meta model -> parallelize -> loader ->
loss -> clip -> optimizer -> metrics -> loggers -> atomic checkpoint; at the end report.md (suite.report)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.data import TokenBatches, ensure_prepared
from suite.data.batch import Batch
from suite.data.prepare import verify_prepared
from suite.models import build_model, flops_per_token, materialize
from suite.models.float8 import prepare_float8
from suite.models.qat import init_learned_scales, prepare_qat
from suite.parallel.dims import ParallelDims
from suite.parallel.env import DistEnv, barrier, init_process_group
from suite.parallel.expert_parallel import moe_step_metrics, update_expert_bias
from suite.parallel.parallelize import parallelize
from suite.parallel.placement import Placement
from suite.runtime import PrecisionPolicy, pick_device, resolve_precision
from suite.train import checkpoint as ckpt
from suite.train import run_folder
from suite.train.flops import Ceiling, memory_gb, memory_metrics
from suite.train.host_memory import apply_host_memory_setting
from suite.train.loggers import MetricsLogger, scrub_secrets, scrub_yaml
from suite.train.loss_scale import inject_inf_gradient, loss_scaler, restore_scaler, scaler_state
from suite.train.optim import optimizer_for
from suite.train.profile import StepProfiler
from suite.train.saver import RunStopped, Saver
from suite.train.schedule import lr_at
from suite.train.step import TrainStep, build_step, training_loss
from suite.train.tensor_memory import peak_summary, tracked_step

SIGTERM_EXIT = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended


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
    def __init__(
        self,
        cfg: SuiteConfig,
        dims: ParallelDims,
        resolved_yaml: str,
        init_weights: Callable[[torch.nn.Module], None] | None = None,
    ):
        """`init_weights(model)`: loads model.init_from into the parallelized model (the verb
        builds it from the model source, suite.model_source.initial_weights; train does not import it)."""
        self.cfg = cfg
        self.init_weights = init_weights
        self.dims = dims
        self.resolved_yaml = resolved_yaml
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

        self._setup_data()
        model = build_model(cfg.model, "meta")
        self._adapt_model(model)
        self.placement: Placement = parallelize(model, cfg, dims, self.device, self.precision)
        self.model = self.placement.model
        if self.placement.materialized is False:
            materialize(self.model, self.device, cfg.train.seed)
        self._load_initial_weights()
        init_learned_scales(self.model, self.device)  # compress.learn_scales: from the weights now in place
        self.optimizer = optimizer_for(self.placement, cfg.optim, cfg.compress.scale_lr)
        self.scaler = loss_scaler(self.device, self.precision)  # fp16: overflow checked over every rank
        self.autocast = autocast_factory(self.device, self.precision)
        self._build_loaders()
        self.step = 0
        self.bad_steps = 0  # non-finite steps skipped, in total (this process's run)
        self.bad_in_a_row = 0
        # (step, loss, grad_norm, ok) of steps whose finiteness flag is still on the device
        self.unread_steps: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.loss_window: deque[float] = deque(maxlen=cfg.train.spike_window)  # spike rollback's good losses
        self.skipped_batches: list[int] = []  # batches a spike rollback never trains on
        self.rollbacks_in_a_row = 0
        self.spiked = False
        self.batch_number = 0
        # async saves' own gloo group (not interleaved with training's); None: single process; False: sync
        self.async_group = False
        if cfg.train.async_save:
            self.async_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        t = cfg.train
        self.saver = Saver(
            self.run_dir, t.keep_last, t.keep_every, self.env.is_main, self.async_group, self._log
        )
        self.saver.fingerprint = run_folder.of_run(cfg, self.verb, getattr(self, "data_dir", None))
        # the per-step SIGTERM check all-reduces a host flag: over gloo when the device is an accelerator
        self.host_group = None
        if dist.is_initialized() and self.device.type != "cpu":
            self.host_group = dist.new_group(backend="gloo")
        self._sigterm = False
        self.resumed = False
        self.runner = self._make_step(
            grad_scaler=self.precision.grad_scaler,
            grad_clip=cfg.optim.grad_clip,
            # chunked cross-entropy where the logits are plain tensors; tp > 1 keeps DTensor's loss_parallel
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            spike_detection=cfg.train.spike_factor > 0,
            host_group=self.host_group,
        )
        if cfg.train.resume:
            self._maybe_resume()
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = Ceiling(self.device, self.precision.name, cfg.train.peak_flops)

    # ---- what finetuning overrides (suite.finetune.trainer) ------------------------------------
    verb = "pretrain"

    def _setup_data(self) -> None:
        """Pretraining: the prepared token shards (built on first use), checked against the model."""
        cfg = self.cfg
        self.data_dir = ensure_prepared(cfg.data, progress=self.env.is_main)
        verify_prepared(self.data_dir)  # sizes + sha256 of shards and tokenizer: one-line error if corrupt
        self.meta = json.loads((self.data_dir / "meta.json").read_text())
        if self.meta["vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.meta['vocab_size']} tokens in {self.data_dir}; set model.vocab_size>={self.meta['vocab_size']}"
            )

    def _make_step(self, **options) -> TrainStep:
        """The step on this rank's placement (distillation adds the teacher's forward to the loss)."""
        loss_fn = training_loss(self.model, bool(self.cfg.model.num_experts))
        return build_step(self.placement, self.optimizer, loss_fn, self.autocast, self.scaler, **options)

    def _adapt_model(self, model: torch.nn.Module) -> None:
        """Change the meta-device model before parallelize: fake quantization (compress=qat-*; LoRA too)."""
        prepare_qat(model, self.cfg.compress)
        prepare_float8(model, self.precision)  # train.precision=fp8: torchao Float8Linear

    def _load_initial_weights(self) -> None:
        """Replace the seeded initialisation with model.init_from's weights, when it is set."""
        if self.cfg.model.init_from and self.init_weights is None:
            raise RuntimeError("model.init_from is set but the Trainer was given no init_weights loader")
        if self.init_weights is not None:
            self.init_weights(self.model)

    def _build_loaders(self) -> None:
        cfg, dims = self.cfg, self.dims
        on_accelerator = self.device.type != "cpu"
        prefetch = on_accelerator if cfg.data.prefetch is None else cfg.data.prefetch
        # data.doc_mask: documents end with EOS (suite.data.documents); the batches carry their positions
        eos_id = int(self.meta["eos_id"]) if cfg.data.doc_mask else None
        self.loader = TokenBatches(
            self.data_dir,
            "train",
            cfg.data.seq_len,
            cfg.parallel.micro_batch_size,
            cfg.parallel.global_batch_size,
            self.placement.dp_rank,
            dims.data_parallel_size,
            cfg.train.seed,
            prefetch=prefetch,
            pin_memory=self.device.type == "cuda",
            eos_id=eos_id,
        )
        self.val_loader = TokenBatches(
            self.data_dir,
            "val",
            cfg.data.seq_len,
            cfg.parallel.micro_batch_size,
            cfg.parallel.micro_batch_size * dims.data_parallel_size,
            self.placement.dp_rank,
            dims.data_parallel_size,
            cfg.train.seed,
            eos_id=eos_id,
        )

    def _write_run_files(self) -> None:
        """Rank 0, at the start of train(): the tokenizer beside config.yaml."""
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (self.data_dir / name).is_file():
                shutil.copyfile(self.data_dir / name, self.run_dir / name)

    def _checkpoint_extra(self):
        """A callable(tmp_folder) that rank 0 runs inside each checkpoint before its manifest, or None.
        Collective work (gathering) happens here, on every rank."""
        return None

    def eval_metrics(self) -> dict:
        """What each evaluation logs; `val_loss` is required."""
        return {"val_loss": self.evaluate()}

    # ---- state -----------------------------------------------------------------------------
    def _log(self, text: str) -> None:
        if self.env.is_main:
            print(text, flush=True)

    def _maybe_resume(self) -> None:
        folder = ckpt.latest_checkpoint(self.run_dir, log=self._log)
        if folder is None:
            return
        state = self._load(folder)
        self.resumed = True
        saved, now = int(state.get("world_size", self.env.world_size)), self.env.world_size
        note = f" (saved by {saved} processes, resharded to {now})" if saved != now else ""
        self._log(f"resumed from {folder} at step {self.step}{note}")

    def _load(self, folder: Path) -> dict:
        """Model, optimizer, RNG, step and data position from `folder` (collective)."""
        state = ckpt.load_checkpoint(folder, self.model, self.optimizer)
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.skipped_batches = sorted(set(self.skipped_batches) | set(state.get("skipped_batches", [])))
        self.loader.load_state_dict(state["data"])
        restore_scaler(self.scaler, state)  # fp16: the loss scale and its growth tracker
        return state

    def save(self, wait: bool = False) -> Path:
        """Write a checkpoint of this step (collective; suite.train.saver); returns its final folder."""
        state = {
            "step": self.step,
            "data": self.loader.state_dict(),
            "bad_steps": self.bad_steps,
            "skipped_batches": list(self.skipped_batches),
            "world_size": self.env.world_size,
            **scaler_state(self.scaler),
        }
        extra = self._checkpoint_extra()
        folder = self.saver.save(self.step, self.model, self.optimizer, state, self.public_yaml, extra, wait)
        self.rollbacks_in_a_row = 0
        return folder

    def finish_pending(self, only_if_done: bool = False) -> Path | None:
        return self.saver.finish_pending(only_if_done)

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (collective when distributed)."""
        return self.runner.any_ranks(flag)[0]

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
        from suite.parallel.describe import describe_layout

        extra = {"precision": self.precision.name, "param_dtype": self.precision.param_dtype_name}
        if self.dims.pp > 1:
            extra["pp_schedule"] = self.cfg.parallel.pp_schedule
        return describe_layout(self.model, self.dims, self.placement.dp_kind, extra)

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    # ---- one step --------------------------------------------------------------------------
    def train_step(
        self, micro_batches: list[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, bool | torch.Tensor]:
        """One optimizer step (suite.train.step: forward/backward, clip, optimizer, the non-finite
        skip) at this step's learning rate. Returns (loss, grad_norm, ok); `self.spiked` tells a
        loss spike (train.spike_factor), which the loop rolls back."""
        lr = lr_at(self.step, self.cfg.optim, self.cfg.sched, self.cfg.train.max_steps)
        result = self.runner(
            micro_batches,
            lr,
            adjust_loss=self._injected_faults,
            before_clip=self._save_gradients if self.step + 1 == self.cfg.train.save_grads_step else None,
            is_spike=self._is_spike if self.cfg.train.spike_factor > 0 else None,
        )
        self.spiked = result.spiked
        return result.loss, result.grad_norm, result.ok

    def _injected_faults(self, loss: torch.Tensor) -> torch.Tensor:
        """Testing aids, inert by default: train.inject_nan_steps / inject_spike_batches, SUITE_FAULT_INF_GRAD."""
        inject_inf_gradient(self.model, self.step + 1)
        if self.step + 1 in self.cfg.train.inject_nan_steps:
            loss = loss * float("nan")
        if self.batch_number in self.cfg.train.inject_spike_batches:
            loss = loss * 100.0
        return loss

    def _save_gradients(self) -> None:
        from suite.train.grad_dump import save_gradients

        save_gradients(self.model, self.run_dir, self.step + 1)

    def _read_step_flags(self, logger) -> None:
        """Account the steps whose finiteness is still on the device (one host read for all)."""
        unread, self.unread_steps = self.unread_steps, []
        if not unread:
            return
        flags = torch.stack([ok for _, _, _, ok in unread]).tolist()
        for (step, loss, grad_norm, _), ok in zip(unread, flags):
            self._count_step(step, bool(ok), loss, grad_norm, logger)

    def _count_step(self, step: int, ok: bool, loss, grad_norm, logger) -> None:
        if ok:
            self.bad_in_a_row = 0
            if self.cfg.train.spike_factor > 0:
                self.loss_window.append(float(loss))
        else:
            self._bad_step(loss, grad_norm, logger, step)

    def _is_spike(self, loss: float) -> bool:
        """train.spike_factor > 0: the loss exceeds that factor times the mean of the last
        train.spike_window good steps (a full window is needed first)."""
        factor, window = self.cfg.train.spike_factor, self.loss_window
        return factor > 0 and len(window) == window.maxlen and loss > factor * sum(window) / len(window)

    def _next_batches(self) -> list[Batch]:
        """The next global batch in data order, passing over batches a spike rollback skipped."""
        while True:
            batches = self.loader.next_step()
            # 1-based number of this batch in data order (batch n is step n's when nothing is skipped)
            self.batch_number = self.loader.epoch * self.loader.steps_per_epoch + self.loader.position
            if self.batch_number not in self.skipped_batches:
                return batches

    def _rollback(self, loss: torch.Tensor, logger) -> None:
        """A loss spike at the step being run: skip its batch for good and restore the newest
        checkpoint in-process (collective; every rank decided alike). The steps since that
        checkpoint are redone on their own batches; the spiking batch is never trained on."""
        t = self.cfg.train
        spike_step = self.step + 1
        mean = sum(self.loss_window) / len(self.loss_window)
        self.skipped_batches = sorted({*self.skipped_batches, self.batch_number})
        self.rollbacks_in_a_row += 1
        self.loss_window.clear()
        what = (
            f"step {spike_step}: loss {float(loss):.4g} is more than train.spike_factor={t.spike_factor:g} x "
            f"the mean {mean:.4g} of the last {t.spike_window} steps"
        )
        if self.rollbacks_in_a_row > t.max_bad_steps:
            good = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
            raise RunStopped(
                f"error: stopping at {what}, after {t.max_bad_steps} rollbacks without a new checkpoint "
                f"(train.max_bad_steps={t.max_bad_steps}); last good checkpoint: {good or 'none'}"
            )
        self.finish_pending()
        barrier()  # rank 0 may just have completed the newest checkpoint: every rank must see it
        folder = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
        if folder is None:
            self._log(
                f"{what}; no checkpoint to roll back to: skipped batch {self.batch_number}, step redone"
            )
            return
        self._load(folder)
        if logger:
            logger.rewind(self.step)
        self._log(
            f"{what}; rolled back to {folder} (step {self.step}) and skipping batch {self.batch_number} "
            f"(skipped so far: {self.skipped_batches})"
        )

    def _bad_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, logger, step: int | None = None) -> None:
        """Count and report a skipped step; stop after train.max_bad_steps in a row."""
        step = self.step if step is None else step
        self.bad_steps += 1
        self.bad_in_a_row += 1
        limit = self.cfg.train.max_bad_steps
        self._log(
            f"step {step}: loss {float(loss):.4g}, grad norm {float(grad_norm):.4g}: not finite; "
            f"optimizer step skipped ({self.bad_in_a_row} in a row, {self.bad_steps} in total)"
        )
        if self.bad_in_a_row >= limit:
            self.finish_pending()
            good = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
            raise RunStopped(
                f"error: stopping at step {step}: {self.bad_in_a_row} non-finite steps in a row "
                f"(train.max_bad_steps={limit}); last good checkpoint: {good or 'none'}"
            )

    def _maybe_fault_kill(self) -> None:
        """Fault-injection aid for tests: train.fault_kill_rank SIGKILLs itself before step
        train.fault_kill_step, on the first attempt only (SUITE_RESTART_COUNT, set by the launcher's
        elastic min:max restarts, or else TORCHELASTIC_RESTART_COUNT: 0 or unset). An asynchronous
        save still in flight is completed first (every rank), so the test knows which checkpoint
        the restart finds."""
        t = self.cfg.train
        attempt = os.environ.get("SUITE_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if t.fault_kill_step is None or self.step + 1 != t.fault_kill_step or attempt != "0":
            return
        if self.async_group is not False:
            self.finish_pending()
            barrier()
        if self.env.rank == t.fault_kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()  # train.eval_batches x micro_batch_size rows in all, the same ones in any layout
        rows = self.cfg.train.eval_batches * self.cfg.parallel.micro_batch_size
        return self.runner.evaluate(self.val_loader.eval_rows(rows))

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        logger = None
        if self.env.is_main:
            (self.run_dir / "config.yaml").write_text(self.public_yaml)
            self._write_run_files()
            config_dict = OmegaConf.to_container(OmegaConf.create(self.public_yaml))
            logger = MetricsLogger(
                self.run_dir, config_dict, cfg.log, cfg.train.max_steps, self.step, self.resumed
            )
            n_params = self.placement.num_params
            logger.print(
                f"[bold]suite {self.verb}[/] {cfg.model.name}: {n_params / 1e6:.1f}M parameters, "
                f"world {self.env.world_size} ({', '.join(f'{k}={v}' for k, v in self.dims.enabled.items()) or 'single process'}), "
                f"{self.precision.name}, run dir {self.run_dir}"
            )
        last_loss = None
        summary: dict = {}
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if on_main_thread else None
        tokens_per_step = cfg.parallel.global_batch_size * cfg.data.seq_len
        profiler = None
        if cfg.train.profile:
            profiler = StepProfiler(cfg.train, self.run_dir, self.device, self.env.rank, self._log)
        try:
            if self.step == 0 and not self.resumed:
                metrics = self.eval_metrics()
                summary |= {f"first_{k}": v for k, v in metrics.items()}
                if logger:
                    logger.log({"step": 0, **metrics})
            window_start, window_steps = time.perf_counter(), 0
            while self.step < cfg.train.max_steps:
                batches = self._next_batches()
                self._maybe_fault_kill()
                loss, grad_norm, ok = tracked_step(self, batches)  # (train.tensor_memory: the last)
                if cfg.model.router_bias_update_rate:  # aux-loss-free balancing: every rank, every step
                    update_expert_bias(self.model, cfg.model)
                if profiler:
                    profiler.step()
                if self.spiked:
                    self._rollback(loss, logger)
                    continue
                self.step += 1  # a skipped step still counts: the bad batch is not retried
                window_steps += 1
                self.finish_pending(only_if_done=True)  # an async save that has finished is completed
                if isinstance(ok, torch.Tensor):  # decided on the device: read at the next logging step
                    self.unread_steps.append((self.step, loss, grad_norm, ok))
                else:
                    self._count_step(self.step, ok, loss, grad_norm, logger)
                log_now = self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps
                if log_now or self.step % cfg.train.save_every == 0 or self.step % cfg.train.eval_every == 0:
                    self._read_step_flags(logger)  # before metrics or a checkpoint count the bad steps
                record = None
                if log_now:
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = tokens_per_step * window_steps / elapsed
                    last_loss = float(loss)
                    record = {
                        "step": self.step,
                        "loss": last_loss,
                        "lr": lr_at(self.step - 1, cfg.optim, cfg.sched, cfg.train.max_steps),
                        "grad_norm": float(grad_norm),
                        "tokens_per_s": tokens_per_s,
                        "mfu": self.peak.mfu(tokens_per_s, self.flops_per_token, self.env.world_size),
                        **memory_metrics(self.device),
                        "bad_steps": self.bad_steps,
                    }
                    if self.precision.grad_scaler:  # fp16: the scale the next step multiplies the loss by
                        record["loss_scale"] = self.scaler.get_scale()
                    if cfg.model.num_experts:  # load balance (and all-to-all bytes) over the window
                        record |= moe_step_metrics(
                            self.model, cfg.model, window_steps, self.placement.ep_traffic
                        )
                    window_start, window_steps = time.perf_counter(), 0
                if self.step % cfg.train.eval_every == 0 or self.step == cfg.train.max_steps:
                    metrics = self.eval_metrics()
                    summary |= {f"last_{k}": v for k, v in metrics.items()}
                    record = (record or {"step": self.step}) | metrics
                    window_start = time.perf_counter()  # keep eval time out of tokens/s
                if record and logger:
                    logger.log(record)
                if logger:
                    logger.advance(self.step, last_loss)
                saved = None
                if self.step % cfg.train.save_every == 0 or self.step == cfg.train.max_steps:
                    saved = self.save()
                    if logger and self.saver.pending is None:
                        logger.print(f"saved checkpoint {saved}")
                    elif logger:
                        logger.print(f"writing checkpoint {saved} in the background")
                    window_start = time.perf_counter()
                if self.step < cfg.train.max_steps and self._any_rank(self._sigterm):
                    self._read_step_flags(logger)
                    # preemption (Slurm sends SIGTERM first): checkpoint this step, then leave
                    saved = (self.finish_pending() or saved) if saved else self.save(wait=True)
                    if logger:
                        logger.close()
                        logger = None
                    self._log(
                        f"stopped by SIGTERM at step {self.step}; saved checkpoint {saved}; "
                        "run the same command again to resume"
                    )
                    raise SystemExit(SIGTERM_EXIT)
            self._read_step_flags(logger)
            self.finish_pending()  # the last save, when asynchronous
            if logger:
                logger.finish()  # report.md + plots (rank 0; a failure is a warning, never the run's)
        except KeyboardInterrupt:
            self.saver.finish_quietly()
            if logger:
                logger.close()
                logger = None
            done = ckpt.latest_checkpoint(self.run_dir, log=lambda _: None)
            where = f"last checkpoint: {done}" if done else "no checkpoint yet"
            self._log(f"interrupted at step {self.step}; {where}; run the same command again to resume")
            raise SystemExit(130) from None
        finally:
            self.saver.finish_quietly()
            if profiler:
                profiler.close()
            if logger:
                logger.close()
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous_handler)
        barrier()
        summary |= {
            "step": self.step,
            "final_loss": last_loss,
            "bad_steps": self.bad_steps,
            "skipped_batches": self.skipped_batches,
            "run_dir": str(self.run_dir),
        }
        summary["state_bytes"] = self.runner.state_bytes()  # params + grads + optimizer state, max over ranks
        summary["mem_gb_per_rank"] = self._gather_floats(memory_gb(self.device))  # peak memory, rank order
        summary |= peak_summary(self)  # train.tensor_memory: the last step's live tensor bytes
        summary["layout"] = self._layout()  # what each rank held (collective)
        if self.env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(scrub_secrets(summary), indent=1))
            print(
                f"wrote {self.run_dir}/ (config.yaml, metrics.jsonl, checkpoints/, summary.json)", flush=True
            )
        return summary
