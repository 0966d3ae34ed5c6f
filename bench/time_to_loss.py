#!/usr/bin/env python
"""Time to loss: steps (and wall time) to a target validation loss, AdamW+cosine vs AdamW+WSD vs Muon+WSD.

    python bench/time_to_loss.py                                  # gpt-tiny, the docs/benchmarks.md row
    python bench/time_to_loss.py --steps 20 --eval-every 5 --adamw-lrs 2e-3 --muon-lrs 4e-3   # a smoke run
    python bench/time_to_loss.py --runs /tmp/ttl --out /tmp/ttl/results.json   # keep the runs, resume

Every run is the real CLI on one process, `suite pretrain recipe=<recipe>` on the embedded corpus,
fp32, the same token budget (--steps x --batch x --seq-len), the same warm-up and the same held-out
rows every --eval-every steps (suite.train.trainer.evaluate), so the arms differ only in optimizer,
schedule and learning rate:

1. the sweep, seed 0: AdamW+cosine over --adamw-lrs, Muon+WSD over --muon-lrs (optim=muon: Muon on
   the hidden matrices, AdamW on the rest, one lr for both, `optim.muon_adjust_lr=match_rms_adamw`);
   each arm's tuned lr is the one with the lowest final validation loss;
2. the tuned lrs again with the other seeds, and AdamW+WSD at AdamW's tuned lr, every seed;
3. the target: the highest final validation loss of tuned AdamW+cosine over the seeds (times
   1 + --target-margin), so that every seed of the reference reaches it; per run, the first
   evaluated step at or below it (none: never reached).

Wall time to the target is the median steps x the arm's seconds per step: the lowest over its runs
of a run's median seconds per step (from its logged tokens/s: training steps only, evaluation
excluded). On a shared machine other processes only add time, so the least-contended run is the
arm's cost; Muon's extra matmuls show in the ratio. Prints a markdown table and the ratios to tuned
AdamW+cosine (medians over seeds); --out writes them as JSON. A run folder that already holds
summary.json is read, not run again (change --runs, or delete it, to measure again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "adamw-cosine": ["optim=adamw", "sched=cosine"],
    "adamw-wsd": ["optim=adamw", "sched=wsd"],
    # fp32 Newton-Schulz: on a CPU without native bf16 (AVX2) torch's bf16 matmuls are emulated, and
    # a 256 x 1024 orthogonalisation took 6.6x longer in bf16 than in fp32 (1.88 s vs 0.28 s, loaded)
    "muon-wsd": ["optim=muon", "sched=wsd", "optim.muon_ns_dtype=fp32"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=60, help="train.max_steps of every run (the token budget)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--target-margin",
        type=float,
        default=0.0,
        help="target = tuned AdamW+cosine's worst final x (1 + this)",
    )
    p.add_argument("--runs", type=Path, default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    return p.parse_args(argv)


def train(args: argparse.Namespace, arm: str, lr: float, seed: int) -> dict:
    """One run (or its folder's earlier result): val losses by step, seconds per step, wall seconds."""
    run = args.runs / f"{arm}-lr{lr:g}-seed{seed}"
    if not (run / "summary.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "suite",
            "pretrain",
            f"recipe={args.recipe}",
            *ARMS[arm],
            f"optim.lr={lr}",
            f"train.seed={seed}",
            f"run.dir={run}",
            "train.overwrite=true",
            "train.precision=fp32",
            f"train.max_steps={args.steps}",
            f"sched.warmup_steps={args.warmup}",
            f"data.seq_len={args.seq_len}",
            f"parallel.global_batch_size={args.batch}",
            f"parallel.micro_batch_size={args.batch}",
            f"train.eval_every={args.eval_every}",
            f"train.eval_batches={args.eval_batches}",
            "train.log_every=1",
            f"train.save_every={args.steps}",
            "log.wandb=false",
            "log.progress=false",
            "log.report=false",
            *args.set,
        ]
        print(f"$ suite pretrain {' '.join(cmd[4:])}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"{arm} lr={lr} seed={seed} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        (run / "bench_wall_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    tokens = args.batch * args.seq_len
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    return {
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "val_loss": val,
        "final_val_loss": val[max(val)],
        "s_per_step": tokens / statistics.median(speeds),
    }


def steps_to(run: dict, target: float) -> int | None:
    """The first evaluated step whose validation loss is at or below `target` (None: never)."""
    return next((s for s, v in sorted(run["val_loss"].items()) if v <= target), None)


def tuned(runs: list[dict], arm: str) -> float:
    """The lr of `arm` with the lowest final validation loss over the sweep (seed 0's runs)."""
    return min((r for r in runs if r["arm"] == arm), key=lambda r: r["final_val_loss"])["lr"]


def median_or_none(values: list) -> float | None:
    return statistics.median(values) if values and None not in values else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.runs = args.runs or Path(tempfile.mkdtemp(prefix="time-to-loss-"))
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    started = time.time()
    load = [os.getloadavg()[0]]
    first, rest = args.seeds[0], args.seeds[1:]
    runs = [train(args, "adamw-cosine", lr, first) for lr in args.adamw_lrs]
    runs += [train(args, "muon-wsd", lr, first) for lr in args.muon_lrs]
    best = {"adamw-cosine": tuned(runs, "adamw-cosine"), "muon-wsd": tuned(runs, "muon-wsd")}
    best["adamw-wsd"] = best["adamw-cosine"]
    runs += [train(args, arm, best[arm], seed) for arm in ("adamw-cosine", "muon-wsd") for seed in rest]
    runs += [train(args, "adamw-wsd", best["adamw-wsd"], seed) for seed in args.seeds]
    load.append(os.getloadavg()[0])
    chosen = {arm: [r for r in runs if r["arm"] == arm and r["lr"] == best[arm]] for arm in ARMS}
    target = max(r["final_val_loss"] for r in chosen["adamw-cosine"]) * (1 + args.target_margin)
    summary: dict = {"target": target, "arms": {}}
    for arm, rs in chosen.items():
        steps = [steps_to(r, target) for r in rs]
        step_s = min(r["s_per_step"] for r in runs if r["arm"] == arm)  # the least-contended run's
        median_steps = median_or_none(steps)
        summary["arms"][arm] = {
            "lr": best[arm],
            "steps_to_target": steps,
            "final_val_loss": [r["final_val_loss"] for r in rs],
            "s_per_step": step_s,
            "median_steps": median_steps,
            "median_wall_s": None if median_steps is None else median_steps * step_s,
        }
    ref = summary["arms"]["adamw-cosine"]
    for a in summary["arms"].values():
        a["steps_ratio"] = (
            a["median_steps"] / ref["median_steps"] if a["median_steps"] and ref["median_steps"] else None
        )
        a["wall_ratio"] = (
            a["median_wall_s"] / ref["median_wall_s"] if a["median_wall_s"] and ref["median_wall_s"] else None
        )
    summary["sweep"] = [
        {k: r[k] for k in ("arm", "lr", "seed", "final_val_loss", "s_per_step")} for r in runs
    ]
    summary["tokens"] = args.steps * args.batch * args.seq_len
    summary["load"] = load
    summary["minutes"] = (time.time() - started) / 60
    print(report(summary, args))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return summary


def report(summary: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{args.recipe}, {args.steps} steps x {args.batch} x {args.seq_len} tokens ({summary['tokens']:,}), "
        f"warm-up {args.warmup}, eval every {args.eval_every} ({args.eval_batches} batches), "
        f"target val loss {summary['target']:.4f}, load {summary['load'][0]:.1f} -> {summary['load'][1]:.1f}, "
        f"{summary['minutes']:.1f} min",
        "",
        "| run (the sweep at seed 0, then the tuned lrs' other seeds) | lr | seed | final val loss | s/step |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arm']} | {r['lr']:g} | {r['seed']} | {r['final_val_loss']:.4f} | {r['s_per_step']:.3f} |"
        for r in summary["sweep"]
    ]
    lines += [
        "",
        "| arm (tuned lr) | lr | steps to target (seeds) | final val loss (seeds) | s/step | steps vs AdamW+cosine | wall vs AdamW+cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, a in summary["arms"].items():
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(
            f"| {arm} | {a['lr']:g} | {', '.join(str(s) for s in a['steps_to_target'])} | "
            f"{', '.join(f'{v:.4f}' for v in a['final_val_loss'])} | "
            f"{a['s_per_step']:.3f} | {fmt(a['steps_ratio'])}x | {fmt(a['wall_ratio'])}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
