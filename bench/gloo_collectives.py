"""gloo's collectives on this machine, each against the ring formula the planner costs it with
(suite.plan.comm): the bandwidth every collective reaches, for the `cpu` cluster preset.

    python bench/gloo_collectives.py                    # 2 ranks, 1 / 16 / 64 MiB, one thread each
    python bench/gloo_collectives.py --ranks 4 --sizes 28

The ranks are real processes over loopback (gloo, one thread each: what bench/plan_cpu.py's runs
use). For each collective and buffer size S (the full, unsharded buffer) the best of --repeats timings
is turned into the bandwidth the planner's formula would need to give that time:

    all-reduce       2 (n-1)/n S / t
    reduce-scatter   (n-1)/n S / t
    all-gather       (n-1)/n S / t

so "efficiency" (each one's bandwidth over all-reduce's) is the factor the preset's
`collective_efficiency` holds for it. Latency is left out (the sizes are large).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20


def _collective(name: str, full: torch.Tensor, shard: torch.Tensor) -> None:
    if name == "all_reduce":
        dist.all_reduce(full)
    elif name == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full)
    else:
        dist.all_gather_into_tensor(full, shard)


def _rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for mib in sizes:
        shard = torch.ones(mib * MIB // 4 // world)
        full = torch.ones(shard.numel() * world)  # divisible by the ranks, as the collectives need
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            _collective(name, full, shard)  # warm-up: connections, buffers
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                _collective(name, full, shard)
                best = min(best, time.perf_counter() - start)
            results[name, mib] = best, full.numel() * 4
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="buffer sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29617)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _rank,
        (args.ranks, args.port, args.sizes, args.repeats, queue),
        nprocs=args.ranks,
        start_method="spawn",
    )
    results = queue.get()
    n = args.ranks
    moved = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    print(
        f"gloo, {n} ranks over loopback, one thread each, torch {torch.__version__}, best of {args.repeats}\n"
    )
    print("| collective | MiB | seconds | bandwidth GB/s (ring formula) | vs all-reduce |")
    print("|---|---:|---:|---:|---:|")
    for mib in args.sizes:
        seconds, size = results["all_reduce", mib]
        ring = moved["all_reduce"] * size / seconds
        for name in moved:
            seconds, size = results[name, mib]
            bandwidth = moved[name] * size / seconds
            print(f"| {name} | {mib} | {seconds:.4f} | {bandwidth / 1e9:.3f} | {bandwidth / ring:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
