"""One validation pass over a composed config: every impossible value becomes a one-line ConfigError."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.parallel.dims import ParallelDims

CHOICES = {
    "model.family": ("gpt", "llama"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "recompute.granularity": ("none", "full", "full_attn", "core_attn"),
    "optim.name": ("adamw",),
    "sched.name": ("cosine", "linear", "constant"),
    "log.wandb_mode": ("offline", "online", "disabled"),
    "launch.backend": ("auto", "nccl", "gloo"),
    "compress.method": ("none",),
    "export.format": ("hf",),
    "export.dtype": ("fp32", "bf16", "fp16"),
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
    "parallel.micro_batch_size",
    "parallel.global_batch_size",
    "generate.max_new_tokens",
)


def _get(cfg: SuiteConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def world_size(cfg: SuiteConfig) -> int:
    nproc = cfg.launch.nproc_per_node
    if isinstance(nproc, str):
        nproc = nproc.split(":")[-1]  # min:max elastic range: the maximum
    try:
        nproc = int(nproc)
    except ValueError:
        raise ConfigError(
            f"launch.nproc_per_node={cfg.launch.nproc_per_node!r} is not a process count; use an integer like 4"
        ) from None
    if nproc < 1:
        raise ConfigError(f"launch.nproc_per_node={nproc} must be at least 1")
    return nproc * cfg.launch.nnodes


def validate(cfg: SuiteConfig, *, needs_data: bool = True) -> ParallelDims:
    """Check everything that can be checked before any process starts; returns the resolved degrees."""
    for key, options in CHOICES.items():
        value = _get(cfg, key)
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(options)}")
    for key in POSITIVE:
        value = _get(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer")
    m = cfg.model
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            "pick heads that divide the hidden size"
        )
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads % kv:
        raise ConfigError(
            f"model.num_kv_heads={kv} does not divide model.num_heads={m.num_heads}; use a divisor of {m.num_heads}"
        )
    if m.family == "llama" and (m.hidden_size // m.num_heads) % 2:
        raise ConfigError(
            f"model.hidden_size/model.num_heads={m.hidden_size // m.num_heads} must be even for RoPE"
        )
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts={m.num_experts} must be >= 0 (0: a dense model)")
    if m.num_experts > 0:
        from suite.models.moe import check_moe_config

        check_moe_config(m)
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be positive, e.g. optim.lr=3e-4")
    t = cfg.train
    for key in ("keep_last", "keep_every"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0 (0 turns it off)")
    if t.max_bad_steps < 1:
        raise ConfigError(f"train.max_bad_steps={t.max_bad_steps} must be a positive integer")
    if t.collective_timeout_s <= 0:
        raise ConfigError(f"train.collective_timeout_s={t.collective_timeout_s} must be positive, e.g. 600")
    for key in ("profile_wait", "profile_warmup", "loss_chunk_tokens"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0")
    if t.profile_steps < 1:
        raise ConfigError(f"train.profile_steps={t.profile_steps} must be a positive integer, e.g. 2")
    if (t.fault_kill_rank is None) != (t.fault_kill_step is None):
        raise ConfigError("train.fault_kill_rank and train.fault_kill_step go together; set both or neither")
    data_path = cfg.data.path
    if (
        needs_data
        and data_path is not None
        and not cfg.data.sources
        and not Path(data_path).expanduser().is_dir()
    ):
        raise ConfigError(
            f"data.path='{data_path}' does not exist; run `suite prepare data.path={data_path} ...` "
            "first, or drop data.path to use the embedded corpus"
        )
    dims = ParallelDims.from_config(cfg.parallel, world_size(cfg))
    dims.validate(cfg.parallel, cfg.model)
    dims.validate_run(cfg)
    return dims
