"""Finetuning acceptance, end to end with the real CLI: held-out exact match before and after.

    python bench/finetune.py --base runs/gpt-tiny                  # full (recipe=sft-tiny), then LoRA
    python bench/finetune.py --base runs/gpt-tiny --methods full --out /tmp/ftbench

For each method it runs, as a user would:
    suite eval ckpt=<base> task=<task>                          accuracy before (once)
    suite finetune recipe=<recipe> model.init_from=<base> run.dir=<out>/<method>
    suite eval ckpt=<out>/<method>                              accuracy after
and prints one markdown table row per method (wall time and CPU time of the finetune command, the
trainable fraction, the load average), plus the raw figures as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

RECIPES = {"full": "sft-tiny", "lora": "sft-tiny-lora"}


def suite(*args: str) -> tuple[str, float, float]:
    """Run `suite <args>` from this checkout; returns (stdout, wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "suite", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"suite {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, wall, cpu


def accuracy(ckpt: str, task: str | None = None) -> dict:
    args = ["eval", f"ckpt={ckpt}", "--json"] + ([f"task={task}"] if task else [])
    out, _, _ = suite(*args)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="runs/gpt-tiny", help="model.init_from: the pretrained base")
    p.add_argument("--methods", default="full,lora")
    p.add_argument("--task", default="reverse-6")
    p.add_argument("--out", default="runs/ftbench")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for `suite finetune`")
    args = p.parse_args()
    before = accuracy(args.base, args.task)
    print(f"before: {before['accuracy']:.1%} ({before['correct']}/{before['total']})", flush=True)
    rows = []
    for method in args.methods.split(","):
        run_dir = Path(args.out) / method
        out, wall, cpu = suite(
            "finetune",
            f"recipe={RECIPES[method]}",
            f"model.init_from={args.base}",
            f"run.dir={run_dir}",
            f"finetune.data.task={args.task}",
            "train.overwrite=true",  # a fresh run each time; an earlier one is moved aside
            "log.progress=false",
            "log.wandb=false",
            *args.overrides,
        )
        trainable = re.search(r"\(([\d.]+)%\)", out) if method == "lora" else None
        after = accuracy(str(run_dir))
        summary = json.loads((run_dir / "summary.json").read_text())
        record = {
            "method": method,
            "task": args.task,
            "before": before["accuracy"],
            "after": after["accuracy"],
            "correct": after["correct"],
            "total": after["total"],
            "steps": summary["step"],
            "finetune_wall_s": round(wall, 1),
            "finetune_cpu_s": round(cpu, 1),
            "trainable_pct": float(trainable.group(1)) if trainable else 100.0,
            "load_avg": [round(x, 1) for x in os.getloadavg()],
            "overrides": args.overrides,
        }
        rows.append(record)
        print(json.dumps(record), flush=True)
    print(
        "\n| method | recipe | steps | accuracy before | accuracy after | finetune wall | finetune CPU | trainable |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['method']} | `{RECIPES[r['method']]}` | {r['steps']} | {r['before']:.1%} | "
            f"{r['after']:.1%} ({r['correct']}/{r['total']}) | {r['finetune_wall_s'] / 60:.1f} min | "
            f"{r['finetune_cpu_s'] / 60:.1f} min | {r['trainable_pct']:.2f}% |"
        )


if __name__ == "__main__":
    main()
