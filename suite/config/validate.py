"""One validation pass over a composed config: every impossible value becomes a one-line ConfigError."""

from __future__ import annotations

from pathlib import Path

from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig
from suite.parallel.dims import ParallelDims

CHOICES = {
    "model.family": ("gpt", "llama"),
    "train.precision": ("fp32", "bf16", "fp16", "auto"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.param_dtype": ("fp32", "bf16"),
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


def resolve_dims(cfg: SuiteConfig, world: int) -> ParallelDims:
    """The parallel degrees for `world` processes, checked against the model, batch and launch."""
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.validate(cfg.parallel, cfg.model)
    dims.validate_run(cfg)
    return dims


def elastic_world_sizes(cfg: SuiteConfig) -> list[int]:
    """World sizes an elastic job (launch.nproc_per_node=min:max) can run on, largest first:
    those in [min, max] for which the parallel degrees resolve (e.g. dp or sharding 'auto' with a
    global batch they divide)."""
    low, high = nproc_range(cfg)
    sizes = []
    for world in range(high, low - 1, -1):
        try:
            resolve_dims(cfg, world)
        except ConfigError:
            continue
        sizes.append(world)
    return sizes


def validate(cfg: SuiteConfig, *, needs_data: bool = True, world: int | None = None) -> ParallelDims:
    """Check everything that can be checked before any process starts; returns the resolved degrees
    (for `world` processes when given: a launched worker of an elastic job passes its own)."""
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
    low, high = nproc_range(cfg)
    dims = resolve_dims(cfg, world or world_size(cfg))
    if low < high and world is None:
        _check_elastic(cfg, low, high)
    _check_param_dtype(cfg, dims)
    return dims


def _check_param_dtype(cfg: SuiteConfig, dims: ParallelDims) -> None:
    """train.param_dtype=bf16: bf16 compute (precision=bf16); fp32 masters in one process (the
    optimizer's) or in FSDP2's sharded parameters (any layout with data parallelism)."""
    t = cfg.train
    if t.param_dtype == "fp32":
        return
    if t.precision != "bf16":
        raise ConfigError(
            f"train.param_dtype={t.param_dtype} needs train.precision=bf16 (got {t.precision}); "
            "set train.precision=bf16 or train.param_dtype=fp32"
        )
    if dims.world_size > 1 and dims.data_parallel_size * dims.cp == 1:
        raise ConfigError(
            f"train.param_dtype=bf16 with {', '.join(f'{k}={v}' for k, v in dims.enabled.items())} and no data "
            "parallelism is not supported yet; add parallel.dp or parallel.sharding, or use train.param_dtype=fp32"
        )
    if cfg.finetune.method == "lora":
        raise ConfigError(
            "train.param_dtype=bf16 with finetune.method=lora is not supported (the frozen base would be "
            "rounded to bf16); use train.param_dtype=fp32"
        )


def _check_elastic(cfg: SuiteConfig, low: int, high: int) -> None:
    """An elastic range must be able to run at its minimum: fixed degrees that need more reject."""
    value = cfg.launch.nproc_per_node
    if cfg.launch.nnodes > 1:
        raise ConfigError(
            f"launch.nproc_per_node={value}: an elastic process range works on one node (launch.nnodes=1); "
            f"with launch.nnodes={cfg.launch.nnodes} use a fixed count like launch.nproc_per_node={high}"
        )
    try:
        resolve_dims(cfg, low)
    except ConfigError as exc:
        raise ConfigError(
            f"launch.nproc_per_node={value} may shrink the job to {low} processes, but there: {exc}; "
            "let one degree follow the world size (parallel.sharding=auto or parallel.dp=auto) or raise the minimum"
        ) from None


def validate_finetune(cfg: SuiteConfig, dims: ParallelDims | None = None) -> None:
    """The finetune section (before the base model is read, and again with the parallel degrees)."""
    ft = cfg.finetune
    for key, value, options in (
        ("finetune.method", ft.method, ("full", "lora")),
        ("finetune.data.truncation", ft.data.truncation, ("truncate", "skip")),
        ("finetune.data.on_error", ft.data.on_error, ("skip", "fail")),
    ):
        if value not in options:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(options)}")
    if not cfg.model.init_from:
        raise ConfigError(
            "model.init_from is missing; finetuning starts from a base model: model.init_from=runs/gpt-tiny "
            "(a `suite pretrain` run) or model.init_from=hf:<folder>"
        )
    if ft.data.task:
        from suite.data.tasks import get_task

        get_task(ft.data.task)  # a one-line error for an unknown name
        if ft.data.sources:
            raise ConfigError(
                f"finetune.data.task={ft.data.task} and finetune.data.sources are both set; pick one"
            )
    elif not ft.data.sources:
        raise ConfigError(
            "finetune.data needs a task or sources: finetune.data.task=reverse-6 or "
            "'finetune.data.sources=[{path: data/chat.jsonl}]'"
        )
    if ft.lora.rank < 1:
        raise ConfigError(f"finetune.lora.rank={ft.lora.rank} must be >= 1; e.g. 8")
    if not 0.0 <= ft.lora.dropout < 1.0:
        raise ConfigError(f"finetune.lora.dropout={ft.lora.dropout} must be in [0, 1)")
    if ft.epochs is not None and ft.epochs <= 0:
        raise ConfigError(f"finetune.epochs={ft.epochs} must be positive (or null: train.max_steps decides)")
    if getattr(cfg.model, "num_experts", 0):
        raise ConfigError(
            f"model.num_experts={cfg.model.num_experts}: finetuning Mixture-of-Experts models is not supported "
            "yet; finetune a dense model"
        )
    if dims is not None and dims.cp > 1:
        raise ConfigError(
            f"parallel.cp={dims.cp}: finetuning does not run under context parallelism yet; use dp, sharding and tp"
        )
    if dims is not None and dims.pp > 1:
        raise ConfigError(
            f"parallel.pp={dims.pp}: finetuning does not run under pipeline parallelism yet (packed "
            "samples need positions and masks passed between stages); use dp, sharding and tp"
        )
