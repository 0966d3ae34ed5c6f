"""Who this process is in the job (from the launcher's environment) and the process group."""

from __future__ import annotations

import atexit
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


def local_world_size() -> int | None:
    """Processes per node, as the launcher (torchrun's elastic agent) set LOCAL_WORLD_SIZE; None
    outside a launch (one node: a single process, or a --dry-run of the whole job)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def node_of(rank: int, per_node: int | None = None) -> int:
    """The node a global rank runs on: torchrun numbers ranks node by node (group_rank x
    local_world_size + local_rank, `per_node` processes on each node)."""
    per_node = per_node or local_world_size()
    return rank // per_node if per_node else 0


def auto_backend(device: torch.device) -> str:
    """nccl for CUDA tensors plus gloo for host ones on GPUs (an offloaded run's gradient-norm and
    clipping collectives run on host tensors; nccl alone has no CPU backend); gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: DistEnv, device: torch.device, backend: str, timeout_s: float) -> None:
    """`auto_backend`, or what the recipe forces (launch.backend, train.collective_timeout_s)."""
    if not env.distributed or dist.is_initialized():
        return
    if backend == "auto":
        backend = auto_backend(device)
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **_restart_store(env, timeout_s),
    )


def init_single_process_group(device: torch.device) -> None:
    """A one-rank process group for a single process whose layout still runs on FSDP2 (parallel.offload
    on one device: FSDP2's CPUOffloadPolicy is the offload engine, and FSDP2 needs a group). An
    in-memory store: nothing listens on a port. Destroyed at exit."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=auto_backend(device),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    atexit.register(destroy_process_group)


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
