"""Checks of single keys' values (choices, positive counts, ranges) and the launch's process counts.

Relations between keys belong to the subsystem that reads them (suite.models.checks,
suite.data.checks, suite.parallel.dims, suite.runtime, suite.finetune.checks); suite.preflight runs
them all once, in the parent, before any process starts.
"""

from __future__ import annotations

from suite.config.cluster import COLLECTIVES
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig

CHOICES = {
    "train.precision": ("fp32", "bf16", "fp16", "fp8", "auto"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.param_dtype": ("fp32", "bf16"),
    "optim.name": ("adamw", "muon"),
    "optim.muon_adjust_lr": ("match_rms_adamw", "original", "none"),
    "optim.muon_ns_dtype": ("auto", "bf16", "fp32"),
    "sched.name": ("cosine", "linear", "constant", "wsd"),
    "sched.decay_shape": ("linear", "cosine", "1-sqrt"),
    "log.wandb_mode": ("offline", "online", "disabled"),
    "launch.backend": ("auto", "nccl", "gloo"),
    "launch.worker_start": ("auto", "fork", "spawn"),
    "export.format": ("hf", "torch_export", "onnx", "gguf"),
    "eval.metric": ("accuracy", "perplexity"),
    "export.dtype": ("fp32", "bf16", "fp16"),
    "generate.dtype": ("fp32", "bf16", "fp16"),
    "cluster.device_type": ("cuda", "cpu"),
    "compress.embedding": ("none", "int8"),
}
POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_heads",
    "model.vocab_size",
    "model.max_seq_len",
    "data.seq_len",
    "data.vocab_size",
    "train.max_steps",
    "train.save_every",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "launch.nnodes",
    "cluster.nodes",
    "cluster.devices_per_node",
    "parallel.micro_batch_size",
    "parallel.global_batch_size",
    "generate.max_new_tokens",
    "optim.muon_ns_steps",
)


def _get(cfg: SuiteConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def nproc_range(cfg: SuiteConfig) -> tuple[int, int]:
    """launch.nproc_per_node as (min, max): `4` is (4, 4); the elastic range `2:4` is (2, 4)."""
    value = cfg.launch.nproc_per_node
    parts = str(value).split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ConfigError(
            f"launch.nproc_per_node={value!r} is not a process count; use an integer like 4, "
            "or an elastic range min:max like 2:4"
        ) from None
    if low < 1 or high < 1:
        raise ConfigError(f"launch.nproc_per_node={value} must be at least 1")
    if low > high:
        raise ConfigError(
            f"launch.nproc_per_node={value}: the minimum {low} exceeds the maximum {high}; write min:max"
        )
    return low, high


def world_size(cfg: SuiteConfig) -> int:
    """The world the job starts with (an elastic range starts at its maximum)."""
    return nproc_range(cfg)[1] * cfg.launch.nnodes


def check_values(cfg: SuiteConfig) -> None:
    """Each key on its own: a supported choice, a positive count, a value in its range."""
    for key, options in CHOICES.items():
        value = _get(cfg, key)
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(options)}")
    for key in POSITIVE:
        value = _get(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer")
    m = cfg.model
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts={m.num_experts} must be >= 0 (0: a dense model)")
    if m.num_kv_heads is not None and m.num_kv_heads < 1:
        divisors = ", ".join(str(d) for d in range(1, m.num_heads + 1) if m.num_heads % d == 0)
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} is not a head count; use null (as many as "
            f"model.num_heads={m.num_heads}) or a divisor of it ({divisors})"
        )
    if cfg.finetune.lora.alpha <= 0:
        raise ConfigError(
            f"finetune.lora.alpha={cfg.finetune.lora.alpha} must be positive (the adapters' update is "
            "scaled by alpha / rank), e.g. finetune.lora.alpha=16"
        )
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive, e.g. optim.lr=3e-4")
    _check_ranges(cfg)
    _check_cluster(cfg)
    t = cfg.train
    for key in ("keep_last", "keep_every"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0 (0 turns it off)")
    if t.max_bad_steps < 1:
        raise ConfigError(f"train.max_bad_steps={t.max_bad_steps} must be a positive integer")
    if t.collective_timeout_s <= 0:
        raise ConfigError(f"train.collective_timeout_s={t.collective_timeout_s} must be positive, e.g. 600")
    if t.spike_factor < 0 or 0 < t.spike_factor <= 1:
        raise ConfigError(
            f"train.spike_factor={t.spike_factor} must be above 1 (e.g. 3: a loss 3x the running mean), or 0 (off)"
        )
    if t.spike_window < 1:
        raise ConfigError(f"train.spike_window={t.spike_window} must be a positive number of steps, e.g. 20")
    for key in ("profile_wait", "profile_warmup", "loss_chunk_tokens"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0")
    if t.profile_steps < 1:
        raise ConfigError(f"train.profile_steps={t.profile_steps} must be a positive integer, e.g. 2")
    if t.compile not in (True, False, "auto"):
        raise ConfigError(f"train.compile={t.compile!r} is not supported; use auto, true or false")
    if cfg.model.attention not in ("sdpa", "explicit", "auto"):
        raise ConfigError(
            f"model.attention={cfg.model.attention!r} is not supported; use auto, sdpa or explicit"
        )
    if t.keep_host_memory not in (True, False, "auto"):
        raise ConfigError(
            f"train.keep_host_memory={t.keep_host_memory!r} is not supported; use auto, true or false"
        )
    if (t.fault_kill_rank is None) != (t.fault_kill_step is None):
        raise ConfigError("train.fault_kill_rank and train.fault_kill_step go together; set both or neither")


def _check_ranges(cfg: SuiteConfig) -> None:
    """Numbers whose sign or range cannot be meant: optimizer, schedule, dropout, threads, run.dir."""
    o, t = cfg.optim, cfg.train
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must be in [0, 1), e.g. {key}=0.9")
    if o.eps <= 0:
        raise ConfigError(f"optim.eps={o.eps} must be positive, e.g. optim.eps=1e-8")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0, e.g. optim.weight_decay=0.1")
    if o.grad_clip < 0:
        raise ConfigError(
            f"optim.grad_clip={o.grad_clip} must be >= 0 (0: no clipping), e.g. optim.grad_clip=1.0"
        )
    if cfg.sched.warmup_steps < 0:
        raise ConfigError(
            f"sched.warmup_steps={cfg.sched.warmup_steps} must be >= 0 (0: no warmup), e.g. sched.warmup_steps=20"
        )
    if not 0.0 <= cfg.sched.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"sched.min_lr_ratio={cfg.sched.min_lr_ratio} must be in [0, 1] (the final lr over optim.lr), e.g. 0.1"
        )
    if not 0.0 < cfg.sched.decay_fraction <= 1.0:
        raise ConfigError(
            f"sched.decay_fraction={cfg.sched.decay_fraction} must be in (0, 1] (the share of train.max_steps "
            "that sched=wsd decays over), e.g. 0.2"
        )
    if cfg.sched.total_steps is not None and cfg.sched.total_steps < 1:
        raise ConfigError(
            f"sched.total_steps={cfg.sched.total_steps} must be at least 1 (the steps the schedule decays "
            "over), or null: train.max_steps"
        )
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), e.g. 0.95")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout={cfg.model.dropout} must be in [0, 1), e.g. model.dropout=0.1")
    if t.num_threads is not None and t.num_threads < 1:
        raise ConfigError(f"train.num_threads={t.num_threads} must be at least 1 (or null: torch's default)")
    if t.peak_flops is not None and t.peak_flops <= 0:
        raise ConfigError(
            f"train.peak_flops={t.peak_flops} must be positive FLOP/s per device (or null: tabled/measured)"
        )
    if not str(cfg.run.dir).strip():
        raise ConfigError("run.dir is empty; name the run's folder, e.g. run.dir=runs/my-run")


def _check_cluster(cfg: SuiteConfig) -> None:
    """cluster.*: sizes, bandwidths and peaks must be positive, efficiencies fractions in (0, 1]."""
    c = cfg.cluster
    for key in (
        "memory_gib",
        "memory_bandwidth_gbs",
        "intra_node_bandwidth_gbs",
        "inter_node_bandwidth_gbs",
        "host_bandwidth_gbs",
        "host_memory_bandwidth_gbs",
    ):
        if getattr(c, key) <= 0:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be positive")
    if c.host_memory_gib is not None and c.host_memory_gib <= 0:
        raise ConfigError(
            f"cluster.host_memory_gib={c.host_memory_gib} must be positive GiB per node (or null: not bounded)"
        )
    for key in ("reserved_gib", "intra_node_latency_us", "inter_node_latency_us"):
        if getattr(c, key) < 0:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be >= 0")
    if c.reserved_gib >= c.memory_gib:
        raise ConfigError(
            f"cluster.reserved_gib={c.reserved_gib} leaves nothing of cluster.memory_gib={c.memory_gib}; "
            "reserve less than the device holds"
        )
    for key in ("compute_efficiency", "intra_node_efficiency", "inter_node_efficiency", "time_share"):
        if not 0.0 < getattr(c, key) <= 1.0:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be in (0, 1], e.g. cluster.{key}=0.8")
    for collective, value in c.collective_efficiency.items():
        if collective not in COLLECTIVES:
            raise ConfigError(
                f"cluster.collective_efficiency.{collective}={value}: not a collective; use one of "
                f"{', '.join(COLLECTIVES)}"
            )
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                f"cluster.collective_efficiency.{collective}={value} must be in (0, 1], "
                f"e.g. cluster.collective_efficiency.{collective}=0.5"
            )
    for precision, value in c.peak_flops.items():
        if value <= 0:
            raise ConfigError(f"cluster.peak_flops.{precision}={value} must be positive FLOP/s per device")
