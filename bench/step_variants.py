#!/usr/bin/env python
"""The suite's training step in variants (config overrides), timed side by side in one process,
and on CUDA a check that the step never synchronises the host with the device.

    python bench/step_variants.py --device cuda                # llama-12x768 bf16, unfused vs fused
    python bench/step_variants.py --device cpu --shape gpt-tiny --reps 5 --steps 2
    python bench/step_variants.py --variants 'base:,fused:model.fused_projections=true'

Each variant is built like bench/throughput.py's suite contender (its shapes, the real
`Trainer.train_step`) on `--device`. Repetitions time `--steps` steps of every variant in turn (order
reversed every other repetition, so drift of a shared machine hits all alike); the table gives median
ms per step and the ratio to the first variant. On CUDA each variant then runs two more steps under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising call (`.item()`,
`float(tensor)`, a pageable copy): "none" in the table means the step has none.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(shape: str, extra: tuple[str, ...], device: str, precision: str):
    """A bare Trainer for `shape` on `device`, plus the micro-batches of one step (already there)."""
    import torch

    import bench.contenders as tp
    from suite.checks import validate
    from suite.config.compose import compose_config, to_object
    from suite.models import build_model, materialize
    from suite.parallel.env import DistEnv
    from suite.parallel.parallelize import parallelize
    from suite.runtime import resolve_auto, resolve_precision
    from suite.train.trainer import Trainer, autocast_factory

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
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dims, trainer.device = cfg, dims, torch.device(device)
    trainer.env = DistEnv.from_environ()
    trainer.precision = resolve_precision(cfg.train, trainer.device)
    torch.manual_seed(cfg.train.seed)
    trainer.parallel = parallelize(
        build_model(cfg.model, "meta"), cfg, dims, trainer.device, trainer.precision
    )
    trainer.model = trainer.parallel.model
    trainer.parallel.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    if trainer.parallel.materialized is False:
        materialize(trainer.model, trainer.device, cfg.train.seed)
    trainer.optimizer = trainer.parallel.build_optimizer(cfg.optim)
    trainer.scaler = torch.amp.GradScaler(device, enabled=False)
    trainer.autocast = autocast_factory(trainer.device, trainer.precision)
    trainer.step = trainer.batch_number = 0
    trainer.bad_steps = trainer.bad_in_a_row = 0
    trainer.loss_window, trainer.spiked = collections.deque(maxlen=cfg.train.spike_window), False
    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen).to(device)
        for _ in range(dims.accumulation(cfg.parallel))
    ]
    return trainer, batches, micro * len(batches) * seq


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
    for trainer, batches, _ in variants.values():
        for _ in range(args.warmup):  # allocator, kernel heuristics, optimizer state
            trainer.train_step(batches)
            trainer.step += 1
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            trainer, batches, _ = variants[name]
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step(batches)
                trainer.step += 1
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)
    syncs = {name: "n/a (cpu)" for name in variants}
    for name, (trainer, batches, _) in variants.items() if cuda else ():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                trainer.train_step(batches)
                trainer.step += 1
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
