#!/usr/bin/env python
"""One AdamW `step()` on CPU, fused against foreach: the measurement behind `optim.fused`'s default.

    python bench/adamw_step.py                       # 16 x 1024 x 1024 fp32 parameters (16.8M), 1 thread
    python bench/adamw_step.py --tensors 32 --threads 2 --reps 9

Each implementation gets its own copy of the same parameters and gradients (two warm-up steps, so the
moments exist), then the implementations take turns, one step each per repetition, order reversed every
other repetition. The figure is the median CPU time of this process over one `step()` (`time.process_time`),
which a busy shared machine disturbs less than wall time; wall time is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}}


def build(kind: str, tensors: int, size: int) -> torch.optim.Optimizer:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, size, generator=gen)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(size, size, generator=gen) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **IMPLEMENTATIONS[kind])
    for _ in range(2):
        optimizer.step()
    return optimizer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=16, help="parameter tensors (default: %(default)s)")
    parser.add_argument(
        "--size", type=int, default=1024, help="each is size x size fp32 (default: %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument(
        "--reps", type=int, default=5, help="timed steps per implementation (default: %(default)s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    optimizers = {kind: build(kind, args.tensors, args.size) for kind in IMPLEMENTATIONS}
    cpu: dict[str, list[float]] = {kind: [] for kind in optimizers}
    wall: dict[str, list[float]] = {kind: [] for kind in optimizers}
    for rep in range(args.reps):
        for kind in list(optimizers) if rep % 2 == 0 else list(optimizers)[::-1]:
            c0, w0 = time.process_time(), time.perf_counter()
            optimizers[kind].step()
            cpu[kind].append(time.process_time() - c0)
            wall[kind].append(time.perf_counter() - w0)
    n = args.tensors * args.size * args.size
    print(
        f"AdamW step, {n / 1e6:.1f}M fp32 parameters in {args.tensors} tensors, torch {torch.__version__}, "
        f"{args.threads} thread(s), median of {args.reps}"
    )
    print("| implementation | CPU ms per step | range | wall ms per step |")
    print("|---|---:|---:|---:|")
    for kind in optimizers:
        lo, hi = min(cpu[kind]) * 1e3, max(cpu[kind]) * 1e3
        print(
            f"| {kind} | {statistics.median(cpu[kind]) * 1e3:.1f} | {lo:.1f}-{hi:.1f} "
            f"| {statistics.median(wall[kind]) * 1e3:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
