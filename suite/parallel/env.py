"""Who this process is in the job (from the launcher's environment) and the process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """cuda:<local_rank> when a GPU is there (or asked for), else cpu."""
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


def init_process_group(
    env: DistEnv, device: torch.device, backend: str = "auto", timeout_s: float = 600
) -> None:
    """nccl on GPUs, gloo on CPU, unless the recipe forces one."""
    if not env.distributed or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **_restart_store(env, timeout_s),
    )


def _restart_store(env: DistEnv, timeout_s: float) -> dict:
    """After an elastic restart, a store namespace of this attempt's own.

    torch's elastic agent keeps one shared store server across restarts and hands every attempt the
    same keys, so the restarted workers read the previous attempt's (dead) gloo addresses and fail
    to connect. A per-attempt PrefixStore over the same server avoids that. First attempts (and
    runs not started by the elastic agent) use the default env:// rendezvous.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return {"store": dist.PrefixStore(f"suite/attempt_{attempt}", store)}


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
