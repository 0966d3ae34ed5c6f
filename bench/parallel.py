"""Parallel benchmark: step time and per-rank peak memory of the main layouts at world size 4 on CPU (gloo).

Each layout is the real CLI, `suite pretrain recipe=gpt-tiny ... launch.nproc_per_node=4`, on one model
shape and global batch; the figures come from what the run wrote: tokens/s of the logged windows after
the first (metrics.jsonl, median), each rank's peak resident set (summary.json `mem_gb_per_rank`) and
the largest rank's parameters + gradients + optimizer state (summary.json `state_bytes`).

    python bench/parallel.py                     # every layout, table printed last
    python bench/parallel.py --layouts dp4 tp4   # a subset
    python bench/parallel.py --append            # also append the table to docs/benchmarks.md
    python bench/parallel.py --precision bf16    # train.precision for every layout (default fp32)

The precision is passed to every run (`train.precision`, fp32 unless `--precision` says otherwise) and each
row reports the precision the run recorded in its config.yaml, so a recipe default never decides it silently.

Timings on a shared machine move with its load: the table records the load average with it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

# name -> (world size, overrides): data parallel, ZeRO stages 1-3, tensor, pipeline, and 2-D mixes.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dp4": (4, ["parallel.dp=4"]),
    "sharding4-stage1": (4, ["parallel.sharding=4", "parallel.sharding_stage=1"]),
    "sharding4-stage2": (4, ["parallel.sharding=4", "parallel.sharding_stage=2"]),
    "sharding4-stage3": (4, ["parallel.sharding=4", "parallel.sharding_stage=3"]),
    "tp4-sp": (4, ["parallel.tp=4", "parallel.sp=true"]),
    "dp2-tp2": (4, ["parallel.dp=2", "parallel.tp=2"]),
    "pp4": (4, ["parallel.pp=4"]),
    "sharding2-pp2": (4, ["parallel.sharding=2", "parallel.pp=2"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "hsdp-dp2-sharding2": (4, ["parallel.dp=2", "parallel.sharding=2"]),
    # 3-D: with all three axes > 1 a layout needs 8 ranks: opt-in with --layouts dp2-tp2-pp2 sharding2-tp2-pp2
    "dp2-tp2-pp2": (8, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]),
    "sharding2-tp2-pp2": (8, ["parallel.sharding=2", "parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]),
}
DEFAULT_LAYOUTS = [name for name, (world, _) in LAYOUTS.items() if world == 4]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shape_args(args: argparse.Namespace) -> list[str]:
    return [
        "recipe=gpt-tiny",
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.width}",
        f"model.num_heads={args.heads}",
        f"data.seq_len={args.seq}",
        f"parallel.micro_batch_size={args.micro_batch}",
        f"parallel.global_batch_size={args.global_batch}",
        f"train.max_steps={args.steps}",
        f"train.log_every={args.log_every}",
        f"train.eval_every={args.steps}",
        "train.eval_batches=1",
        f"train.save_every={args.steps * 10}",  # only the final checkpoint
        "log.wandb=false",
        "log.progress=false",
        f"train.precision={args.precision}",
    ]


def run_layout(name: str, args: argparse.Namespace, root: Path) -> dict:
    world, overrides = LAYOUTS[name]
    run_dir = root / name
    cmd = [sys.executable, "-m", "suite", "pretrain", *shape_args(args), *overrides]
    cmd += [f"run.dir={run_dir}", f"launch.nproc_per_node={world}", f"train.num_threads={args.threads}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"layout": name, "world": world, "error": " / ".join(tail)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    windows = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first pays start-up
    summary = json.loads((run_dir / "summary.json").read_text())
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["precision"]  # what the run resolved
    tokens_per_s = statistics.median(windows)
    per_rank = summary.get("mem_gb_per_rank") or [records[-1].get("mem_gb", 0.0)]
    return {
        "layout": name,
        "world": world,
        "overrides": " ".join(overrides),
        "precision": ran,
        "tokens_per_s": tokens_per_s,
        "step_s": args.global_batch * args.seq / tokens_per_s,
        "mem_gb_per_rank": per_rank,
        "state_mb": summary["state_bytes"]["total"] / 2**20,
        "final_loss": summary["final_loss"],
        "run_s": wall,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| layout | ranks | overrides | precision | tokens/s | s/step | peak RSS GB per rank | state MB (largest rank) "
        "| final loss |",
        "|---|---:|---|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['world']} | failed: {r['error']} | | | | | | |")
            continue
        mems = " / ".join(f"{m:.2f}" for m in r["mem_gb_per_rank"])
        lines.append(
            f"| {r['layout']} | {r['world']} | `{r['overrides']}` | {r['precision']} | {r['tokens_per_s']:,.0f} "
            f"| {r['step_s']:.2f} "
            f"| {mems} | {r['state_mb']:.1f} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-every", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "auto"],
        help="train.precision for every layout (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per layout")
    parser.add_argument("--append", action="store_true", help="append the table to docs/benchmarks.md")
    args = parser.parse_args()

    started = dt.datetime.now(dt.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="suite-bench-parallel-") as tmp:
        for name in args.layouts:
            row = run_layout(name, args, Path(tmp))
            rows.append(row)
            status = row.get("error") or f"{row['tokens_per_s']:,.0f} tokens/s in {row['run_s']:.0f} s"
            print(f"{name}: {status}", flush=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    import torch

    header = (
        f"## Parallel layouts, {started:%Y-%m-%d %H:%M} UTC: `{' '.join(['python bench/parallel.py', *sys.argv[1:]])}`\n\n"
        f"- machine: {cpu_name()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, gloo, {args.threads} thread(s) per rank; load average at the end {load} (1 / 5 / 15 min)\n"
        f"- shape: `recipe=gpt-tiny` GPT, {args.layers} layers, width {args.width}, {args.heads} heads, vocabulary "
        f"8192, seq {args.seq}, global batch {args.global_batch} (micro-batches of {args.micro_batch}), "
        f"`train.precision={args.precision}` (the precision column: what each run recorded), "
        f"AdamW; {args.steps} steps, tokens/s = median of the logged windows of {args.log_every} steps after the first\n"
        "- peak RSS is each rank's peak resident set (the whole process: Python, torch, gloo buffers), state MB "
        "the largest rank's parameters + gradients + optimizer state\n"
        "- more ranks than cores time-share the CPU: compare memory across layouts, and read tokens/s as the "
        "cost of each layout's communication on one machine, not as its speed on real hardware\n"
    )
    text = header + "\n" + table(rows) + "\n"
    if args.append:
        with (REPO / "docs" / "benchmarks.md").open("a") as docs:
            docs.write("\n" + text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
