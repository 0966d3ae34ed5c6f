"""Distillation acceptance, end to end with the real CLI: a half-size student with and without its teacher.

    python bench/distill.py                              # teacher runs/sft-tiny (made first when missing)
    python bench/distill.py --teacher runs/sft-tiny --out /tmp/distill --steps 800 --seed 1
    python bench/distill.py --set distill.hidden_weight=0 --set distill.ce_weight=0.5   # other settings
    python bench/distill.py --out /tmp/distill --keep    # students already finished there are not re-run
    python bench/distill.py --teacher runs/sft-llama-tiny --student model=llama-tiny --student model.num_layers=2 \
        --student model.hidden_size=128 --student model.num_heads=4 --student model.num_kv_heads=2 \
        --student model.ffn_hidden_size=352          # llama-tiny: half the layers and width

Runs, as a user would (the teacher first when --teacher does not exist: `suite pretrain` then
`suite finetune recipe=sft-tiny`):
    suite eval ckpt=<teacher>                                               the teacher's accuracy
    suite distill recipe=distill-sft-tiny run.dir=<out>/distilled            student with the teacher
    suite distill recipe=distill-sft-tiny run.dir=<out>/alone distill.ce_weight=1.0 distill.hidden_weight=0
                                                                           the same student, hard labels only
    suite eval ckpt=<out>/distilled, suite eval ckpt=<out>/alone
and prints a markdown table: parameters, held-out loss per assistant token (the final val_loss), exact
match on the task's 200 held-out questions, wall time. The student (recipe distill-sft-tiny) has half
the teacher's layers and width and starts from scratch; both students see the same rows in the same
order for the same number of steps (`--seed`: train.seed of both); `--set key=value` (repeatable) changes
the distilled student's settings only (the recipe's are the distillation defaults), e.g. to compare
with logit distillation alone: --set distill.hidden_weight=0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def suite(*args: str) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "suite", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"suite {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout, time.perf_counter() - start


def accuracy(ckpt: Path) -> dict:
    out, _ = suite("eval", f"ckpt={ckpt}", "--json")
    return json.loads(out.strip().splitlines()[-1])


def last_val_loss(run: Path) -> float | None:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    values = [r["val_loss"] for r in rows if "val_loss" in r]
    return values[-1] if values else None


def params(run: Path) -> int:
    """Parameters of the run's model (tied weights once), counted on the meta device."""
    from suite.config.compose import load_saved_config
    from suite.models import build_model

    model = build_model(load_saved_config(run / "config.yaml").model, "meta")
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="runs/sft-tiny")
    parser.add_argument("--out", default="runs/distill-bench")
    parser.add_argument("--steps", type=int, default=None, help="student steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=None, help="train.seed of both students")
    parser.add_argument(
        "--keep", action="store_true", help="keep a student whose folder holds a finished run (summary.json)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override of the distilled run"
    )
    parser.add_argument(
        "--student", action="append", default=[], metavar="KEY=VALUE",
        help="an override of both students (the model: e.g. model=llama-tiny model.num_layers=2 ...)",
    )  # fmt: skip
    args = parser.parse_args()
    teacher, out = Path(args.teacher), Path(args.out)
    if not teacher.exists():
        suite("pretrain")
        suite("finetune", "recipe=sft-tiny", f"run.dir={teacher}")
    steps = [f"train.max_steps={args.steps}"] if args.steps else []
    steps += [f"train.seed={args.seed}"] if args.seed is not None else []
    rows = [(f"teacher ({teacher.name})", teacher, None)]
    alone = ["distill.ce_weight=1.0", "distill.hidden_weight=0"]
    for name, extra in (("distilled", args.set), ("alone", alone)):
        run = out / name
        if args.keep and (run / "summary.json").exists():
            rows.append((f"student {name} (kept: {run})", run, None))
            continue
        _, wall = suite(
            "distill", "recipe=distill-sft-tiny", f"distill.teacher={teacher}", f"run.dir={run}",
            "train.overwrite=true", "log.progress=false", *args.student, *steps, *extra,
        )  # fmt: skip
        note = "ce_weight=1, hidden_weight=0: no teacher" if extra is alone else " ".join(extra)
        rows.append((f"student {name}" + (f" ({note})" if note else ""), run, wall))
    print("| model | parameters | held-out loss | exact match | wall |")
    print("|---|---:|---:|---:|---:|")
    for name, run, wall in rows:
        acc = accuracy(run)
        loss = last_val_loss(run)
        print(
            f"| {name} | {params(run):,} | {loss:.3g} | {acc['accuracy']:.1%} ({acc['correct']}/{acc['total']}) | "
            + (f"{wall / 60:.1f} min |" if wall else "- |")
        )
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
