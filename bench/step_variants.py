#!/usr/bin/env python
"""The suite's training step in variants (config overrides), timed side by side in one process,
and on CUDA a check that the step never synchronises the host with the device.

    python bench/step_variants.py --device cuda                # llama-12x768 bf16, unfused vs fused
    python bench/step_variants.py --device cpu --shape gpt-tiny --reps 5 --steps 2
    python bench/step_variants.py --variants 'base:,fused:model.fused_projections=true'

Each variant is built like bench/throughput.py's suite contender (its shapes, the trainer's own
step: `suite.train.trainer.standalone_step`) on `--device`. Repetitions time `--steps` steps of every variant in turn (order
reversed every other repetition, so drift of a shared machine hits all alike); the table gives median
ms per step and the ratio to the first variant. On CUDA each variant then runs two more steps under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising call (`.item()`,
`float(tensor)`, a pageable copy): "none" in the table means the step has none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(shape: str, extra: tuple[str, ...], device: str, precision: str):
    """The trainer's step for `shape` on `device` (suite.train.trainer.standalone_step), as a
    callable running one step at the loop's learning rate, plus the micro-batches of one step."""
    import torch

    import bench.contenders as tp
    from suite.config.compose import compose_config, to_object
    from suite.data.batch import Batch
    from suite.preflight import validate
    from suite.runtime import resolve_auto
    from suite.train.schedule import lr_at
    from suite.train.trainer import standalone_step

    spec = tp.SHAPES[shape]
    cfg = to_object(
        resolve_auto(
            compose_config(
                [
                    f"recipe={spec.recipe}",
                    *spec.overrides,
                    f"train.precision={precision}",
                    f"train.device={device}",
                ]
                + list(extra)
            )
        )
    )
    dims = validate(cfg, needs_data=False)
    runner = standalone_step(cfg, dims, torch.device(device))
    done = [0]

    def step(batches) -> None:
        runner(batches, lr_at(done[0], cfg.optim, cfg.sched, cfg.train.max_steps))
        done[0] += 1

    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    batches = [
        Batch.from_windows(torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen).to(device))
        for _ in range(dims.accumulation(cfg.parallel))
    ]
    return step, batches, micro * len(batches) * seq


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-12x768", help="a bench/throughput.py shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument(
        "--variants",
        default="unfused:,fused:model.fused_projections=true",
        help="comma-separated NAME:OVERRIDE[;OVERRIDE...] (default: %(default)s)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    variants = {}
    for item in args.variants.split(","):
        name, _, overrides = item.partition(":")
        extra = tuple(o for o in overrides.split(";") if o)
        variants[name] = build(args.shape, extra, args.device, args.precision)
    for step, batches, _ in variants.values():
        for _ in range(args.warmup):  # allocator, kernel heuristics, optimizer state
            step(batches)
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            step, batches, _ = variants[name]
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(batches)
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)
    syncs = {name: "n/a (cpu)" for name in variants}
    for name, (step, batches, _) in variants.items() if cuda else ():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                step(batches)
            syncs[name] = "none"
        except RuntimeError as exc:
            syncs[name] = str(exc).splitlines()[0][:80]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    first = next(iter(variants))
    where = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"\n{where}, torch {torch.__version__}, {args.shape} {args.precision}, {args.reps} reps x {args.steps} steps"
    )
    print("| variant | ms/step (median) | per rep | tokens/s | speed vs first | host sync in the step |")
    print("|---|---|---|---|---|---|")
    for name, (_, _, tokens) in variants.items():
        med = statistics.median(times[name])
        ratio = statistics.median(times[first]) / med
        reps = " ".join(f"{t * 1e3:.0f}" for t in times[name])
        print(f"| {name} | {med * 1e3:.1f} | {reps} | {tokens / med:,.0f} | {ratio:.3f}x | {syncs[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
