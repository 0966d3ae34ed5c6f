#!/usr/bin/env python
"""The suite's training step on one CUDA device: step time of model variants, interleaved, and a
check that the step never synchronises the host with the device.

    python bench/gpu_step.py                                   # llama-12x768 bf16, unfused vs fused
    python bench/gpu_step.py --shape gpt-12x768 --reps 5 --steps 10

Each variant is built exactly as bench/throughput.py builds the suite contender (its `suite_config`
and the real `Trainer.train_step`), but on `cuda`. Repetitions time `--steps` steps of every
variant in turn (order reversed every other repetition) between `torch.cuda.synchronize()` calls;
the table gives median tokens/s. Then each variant runs two more steps under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising CUDA call (`.item()`,
`float(tensor)`, a pageable copy): "no sync" in the table means the step has none.
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


def build(shape: str, extra: tuple[str, ...]):
    """Trainer.train_step of `shape` on cuda, plus the micro-batches of one step (already on the GPU)."""
    import torch

    import bench.throughput as tp
    from suite.config.compose import compose_config, to_object
    from suite.config.validate import validate
    from suite.models import build_model, materialize
    from suite.parallel.env import DistEnv
    from suite.parallel.parallelize import parallelize
    from suite.train.trainer import AUTOCAST_DTYPES, Trainer

    spec = tp.SHAPES[shape]
    cfg = to_object(
        compose_config(
            [f"recipe={spec.recipe}", *spec.overrides, "train.precision=bf16", "train.device=cuda", *extra]
        )
    )
    dims = validate(cfg, needs_data=False)
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.dims, trainer.device = cfg, dims, torch.device("cuda")
    trainer.env = DistEnv.from_environ()
    torch.manual_seed(cfg.train.seed)
    trainer.parallel = parallelize(build_model(cfg.model, "meta"), cfg, dims, trainer.device)
    trainer.model = trainer.parallel.model
    trainer.parallel.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    if trainer.parallel.materialized is False:
        materialize(trainer.model, trainer.device, cfg.train.seed)
    trainer.optimizer = trainer.parallel.build_optimizer(cfg.optim)
    trainer.scaler = torch.amp.GradScaler("cuda", enabled=False)
    dtype = AUTOCAST_DTYPES[cfg.train.precision]
    trainer.autocast = lambda: torch.autocast("cuda", dtype=dtype)
    trainer.step = trainer.batch_number = 0
    trainer.bad_steps = trainer.bad_in_a_row = 0
    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen).cuda()
        for _ in range(dims.accumulation(cfg.parallel))
    ]
    return trainer, batches, micro * len(batches) * seq


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-12x768")
    parser.add_argument(
        "--variants",
        default="unfused:,fused:model.fused_projections=true",
        help="comma-separated NAME:OVERRIDE[;OVERRIDE...] (default: %(default)s)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    variants = {}
    for item in args.variants.split(","):
        name, _, overrides = item.partition(":")
        variants[name] = build(args.shape, tuple(o for o in overrides.split(";") if o))
    for trainer, batches, _ in variants.values():
        for _ in range(3):  # warm-up: allocator, cuBLAS heuristics, optimizer state
            trainer.train_step(batches)
            trainer.step += 1
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            trainer, batches, _ = variants[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step(batches)
                trainer.step += 1
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
    syncs = {}
    for name, (trainer, batches, _) in variants.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                trainer.train_step(batches)
                trainer.step += 1
            syncs[name] = "no sync"
        except RuntimeError as exc:
            syncs[name] = f"syncs: {str(exc).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    first = next(iter(variants))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape} bf16")
    print("| variant | ms/step (median) | tokens/s | vs first | host sync in the step |")
    print("|---|---|---|---|---|")
    for name, (_, _, tokens) in variants.items():
        med = statistics.median(times[name])
        ratio = statistics.median(times[first]) / med
        print(f"| {name} | {med * 1e3:.1f} | {tokens / med:,.0f} | {ratio:.3f}x | {syncs[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
