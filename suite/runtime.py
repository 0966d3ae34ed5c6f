"""What this machine can do: device choice, native low-precision support, and the 'auto' values
that depend on them. Sits just above suite.config (imports torch and config only), so the CLI can
settle a recipe's `auto` values before any process starts and every layer below reads one answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from suite.config.errors import ConfigError


def pick_device(requested: str, env) -> torch.device:
    """cuda:<local_rank> when a GPU is there (or asked for), else cpu (`env`: a suite.parallel.env.DistEnv)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def auto_precision(requested_device: str) -> str:
    """`train.precision=auto`: bf16 autocast where the device computes bf16 natively, else fp32.

    CPUs without AVX-512 BF16 / AMX emulate bf16 matmuls (slower than fp32), so the CPU check asks
    oneDNN, which is what runs them.
    """
    if requested_device != "cpu" and torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if requested_device == "cuda":
        return "fp32"  # no GPU visible: validation reports that; keep the choice well defined
    return "bf16" if cpu_computes_natively("bf16") else "fp32"


def cpu_computes_natively(precision: str) -> bool:
    """Whether oneDNN, which runs CPU matmuls, computes `precision` in hardware (bf16: AVX-512 BF16 or
    AMX; fp16: AVX-512 FP16 or AMX-FP16); fp32 always."""
    if precision not in ("bf16", "fp16"):
        return True
    mkldnn = torch.ops.mkldnn
    supported = mkldnn._is_mkldnn_bf16_supported if precision == "bf16" else mkldnn._is_mkldnn_fp16_supported
    return torch.backends.mkldnn.is_available() and supported()


def emulates_low_precision(device: torch.device, precision: str) -> bool:
    """Training on a CPU that would emulate `precision`: bf16 measured ~100x slower than fp32 on AVX2 alone."""
    return device.type == "cpu" and not cpu_computes_natively(precision)


EXPLICIT_ATTENTION_MAX_SEQ = 2048  # measured faster than the CPU flash kernel up to here (performance.md)


def auto_attention(requested_device: str, precision: str, seq_len: int) -> str:
    """`model.attention=auto`: the explicit score matrix where it beats the fused kernel, else sdpa.

    On CPU in bf16/fp16 one [seq, seq] matmul + softmax + matmul per head ran fwd+bwd in half the time of
    torch's CPU flash kernel at seq 256-512 and still ahead at 2048; in fp32 they were even, and on GPUs
    the flash kernels win (and never hold the [seq, seq] scores).
    """
    on_cpu = requested_device == "cpu" or (requested_device == "auto" and not torch.cuda.is_available())
    low_precision = precision in ("bf16", "fp16")
    return "explicit" if on_cpu and low_precision and seq_len <= EXPLICIT_ATTENTION_MAX_SEQ else "sdpa"


def resolve_auto(cfg: DictConfig) -> DictConfig:
    """Settle a composed config's machine-dependent `auto` values in place (and return it), so the
    run's config.yaml records what ran and no later layer probes the hardware again."""
    if cfg.train.precision == "auto":
        cfg.train.precision = auto_precision(cfg.train.device)
    if cfg.model.attention == "auto":
        cfg.model.attention = auto_attention(cfg.train.device, cfg.train.precision, cfg.data.seq_len)
    if cfg.optim.muon_ns_dtype == "auto":  # Newton-Schulz in bf16 only where bf16 is native
        cfg.optim.muon_ns_dtype = "bf16" if auto_precision(cfg.train.device) == "bf16" else "fp32"
    return cfg


def check_device(device: str) -> None:
    """train.device is one this machine has (every verb that runs a model checks it first)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={device!r} is not supported; use one of: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device=cuda but this machine has no CUDA device (torch {torch.__version__}); "
            "use train.device=cpu, or train.device=auto to take a GPU where there is one"
        )


FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L4, L40S) and Hopper (H100, H200)


def check_fp8(requested_device: str) -> None:
    """train.precision=fp8 (torchao float8 training) needs a CUDA GPU with float8 tensor cores."""
    if requested_device == "cpu" or not torch.cuda.is_available():
        where = "train.device=cpu" if requested_device == "cpu" else "this machine has no CUDA device"
        raise ConfigError(
            f"train.precision=fp8 needs an NVIDIA GPU with float8 tensor cores (Hopper H100/H200, Ada L4/L40S) "
            f"but {where}; use train.precision=bf16"
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"train.precision=fp8 needs float8 tensor cores (compute capability 8.9+: Hopper H100/H200, Ada "
            f"L4/L40S) but {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}; use train.precision=bf16"
        )


def check_precision(cfg, dims) -> None:
    """train.param_dtype=bf16: bf16 compute (precision=bf16); fp32 masters in the optimizer (one process,
    tp, pp: each rank's part) or in FSDP2's sharded parameters (any layout with data parallelism).
    `cfg`: a SuiteConfig; `dims`: the resolved suite.parallel.dims.ParallelDims."""
    t = cfg.train
    if t.precision == "fp8":
        check_fp8(cfg.train.device)
        if dims.tp > 1 or dims.pp > 1:
            raise ConfigError(
                f"train.precision=fp8 with parallel.tp={dims.tp} parallel.pp={dims.pp} is not supported yet (float8 "
                "linears are placed by data parallelism and FSDP only); use parallel.tp=1 parallel.pp=1, or bf16"
            )
    if t.param_dtype == "fp32":
        return
    if t.precision != "bf16":
        raise ConfigError(
            f"train.param_dtype={t.param_dtype} needs train.precision=bf16 (got {t.precision}); "
            "set train.precision=bf16 or train.param_dtype=fp32"
        )
    if cfg.finetune.method == "lora":
        raise ConfigError(
            "train.param_dtype=bf16 with finetune.method=lora is not supported (the frozen base would be "
            "rounded to bf16); use train.param_dtype=fp32"
        )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """train.precision and train.param_dtype resolved once (suite.runtime.resolve_precision) and
    passed as an object, so no module re-reads the strings or keeps its own string-to-dtype map."""

    name: str  # fp32 | bf16 | fp16 ('auto' is settled at compose time)
    compute_dtype: torch.dtype  # what matmuls run in (FSDP2's all-gathered parameters, autocast)
    param_dtype: torch.dtype  # what the model's parameters hold (train.param_dtype)
    autocast_dtype: torch.dtype | None  # autocast over fp32 parameters; None: none (fp32, or bf16 params)
    reduce_dtype: torch.dtype  # gradient reduction across data-parallel ranks
    master_dtype: torch.dtype | None  # the optimizer's master copies of low-precision params; None: none
    grad_scaler: bool  # fp16: loss scaling (torch.amp.GradScaler)
    emulated: bool  # this device only emulates compute_dtype (a CPU without native bf16/fp16)
    float8: bool = False  # fp8: bf16 autocast plus torchao Float8Linear matmuls (suite.models.float8)

    @property
    def low_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def param_dtype_name(self) -> str:
        """train.param_dtype as the recipe spells it (for summaries)."""
        return next(name for name, dtype in DTYPES.items() if dtype == self.param_dtype)


def resolve_precision(train, device: torch.device | None = None) -> PrecisionPolicy:
    """The policy of a recipe's train section (suite.config.schema.TrainConfig) on `device`
    (a config that skipped resolve_auto gets its 'auto' settled here the same way)."""
    name = auto_precision(train.device) if train.precision == "auto" else train.precision
    compute = DTYPES["bf16" if name == "fp8" else name]  # fp8: the Linear matmuls only, the rest bf16
    params = DTYPES[train.param_dtype]
    return PrecisionPolicy(
        name=name,
        compute_dtype=compute,
        param_dtype=params,
        autocast_dtype=compute if compute != torch.float32 and params == torch.float32 else None,
        reduce_dtype=torch.float32,
        master_dtype=torch.float32 if params != torch.float32 else None,
        grad_scaler=name == "fp16",
        emulated=device is not None and emulates_low_precision(device, name),
        float8=name == "fp8",
    )
