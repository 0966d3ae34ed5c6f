"""Post-training after SFT (issue 42, acceptance item 4): held-out exact match after SFT, after DPO, after
SimPO and after GRPO, each started from the same SFT model, over several seeds, with the real CLI.

    python bench/posttrain.py --base runs/gpt-tiny --out /tmp/posttrain              # 3 seeds
    python bench/posttrain.py --base runs/gpt-tiny --out /tmp/posttrain --sft-seed 0  # one SFT model
    python bench/posttrain.py --base runs/gpt-tiny --out /tmp/posttrain --seeds 0 --grpo-steps 60
    python bench/posttrain.py --out /tmp/posttrain --table                           # what finished there
    python bench/posttrain.py ... --set grpo:optim.lr=1e-4 --set dpo:align.beta=0.2  # a stage's settings

Each seed is one `suite run` pipeline (written to <out>/seed-<N>/posttrain.yaml, run in <out>/seed-<N>):

    sft        suite finetune recipe=sft-addition-tiny model.init_from=<base>    (addition-2)
    eval-sft   suite eval ckpt=<sft> eval.num_samples=200                         held-out exact match
    dpo        suite align recipe=dpo-addition-tiny model.init_from=<sft>       (pairs of its own mistakes)
    eval-dpo   suite eval ckpt=<dpo> task=addition-2 eval.num_samples=200
    simpo      suite align recipe=dpo-addition-tiny align.method=simpo align.rpo_alpha=0 (the same pairs)
    eval-simpo suite eval ckpt=<simpo> task=addition-2 eval.num_samples=200
    grpo       suite align recipe=grpo-tiny model.init_from=<sft>                 (exact-match reward)
    eval-grpo  suite eval ckpt=<grpo> task=addition-2 eval.num_samples=200

Every setting (steps, learning rates, DPO's and GRPO's keys) is the recipe's unless --sft-steps,
--dpo-steps, --simpo-steps, --grpo-steps or --set STAGE:key=value give another; the recipes hold the
settings measured in docs/benchmarks.md, "Post-training after SFT".

The seed is train.seed of every training stage (its data order, DPO's sampled pairs, GRPO's rollouts).
SFT's end accuracy depends on its seed far more than the later stages' gains do (docs/benchmarks.md:
58% at seed 0, 14.5% at seed 1), so `--sft-seed S` trains SFT once, in seed S's pipeline, and starts
every seed's DPO, SimPO and GRPO from that model: 3 seeds of post-training from one SFT start.
The task's questions (finetune.data.task_seed) stay fixed, so every
evaluation scores the same 200 held-out questions, none of which any stage trained on. A rerun skips
the stages that finished (suite run's markers), so an interrupted bench continues where it stopped. Prints a markdown table (exact match per stage and seed,
each later stage's gain over its SFT start in points, each stage's wall time) and writes
<out>/results.json. Targets (issue 42): DPO +5 points, GRPO +10 points averaged over 3 seeds, each
stage within 15 minutes on this CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TASK = "addition-2"
QUIET = ["log.wandb=false", "log.progress=false"]
TRAINED = ("sft", "dpo", "simpo", "grpo")
POST = TRAINED[1:]  # each compared with its SFT start
TARGETS = {"dpo": 5.0, "grpo": 10.0}  # points of held-out exact match over the SFT start (issue 42)


def steps(count: int | None) -> list[str]:
    """train.max_steps=<count>, or nothing: the recipe's."""
    return [] if count is None else [f"train.max_steps={count}"]


def sft_folder(args: argparse.Namespace) -> Path:
    """Where --sft-seed's SFT model is: the SFT stage of that seed's pipeline."""
    return args.out / f"seed-{args.sft_seed}" / "run" / "sft"


def stages(args: argparse.Namespace, seed: int) -> dict[str, tuple[str, list[str]]]:
    """Each stage's verb and arguments (--set STAGE:key=value appended to its stage's). With --sft-seed,
    only that seed's pipeline trains SFT; the other seeds' DPO, SimPO and GRPO start from its model."""
    seeded = [f"train.seed={seed}", *QUIET]
    evaluated = [f"eval.num_samples={args.eval_samples}"]
    shared = args.sft_seed is not None and seed != args.sft_seed
    start = str(sft_folder(args)) if shared else "${stage:sft}"
    out = {
        "sft": (
            "finetune",
            [
                "recipe=sft-addition-tiny",
                f"model.init_from={args.base}",
                *steps(args.sft_steps),
                "train.eval_every=100000",
                *seeded,
            ],
        ),
        "eval-sft": ("eval", ["ckpt=${stage:sft}", *evaluated]),
        "dpo": (
            "align",
            [
                "recipe=dpo-addition-tiny",
                f"model.init_from={start}",
                *steps(args.dpo_steps),
                "train.eval_every=100000",
                *seeded,
            ],
        ),
        "eval-dpo": ("eval", ["ckpt=${stage:dpo}", f"task={TASK}", *evaluated]),
        "simpo": (
            "align",
            [
                "recipe=dpo-addition-tiny",  # the same pairs, learning rate and steps as DPO
                "align.method=simpo",
                "align.rpo_alpha=0",
                f"model.init_from={start}",
                *steps(args.simpo_steps),
                "train.eval_every=100000",
                *seeded,
            ],
        ),
        "eval-simpo": ("eval", ["ckpt=${stage:simpo}", f"task={TASK}", *evaluated]),
        "grpo": (
            "align",
            [
                "recipe=grpo-tiny",
                f"model.init_from={start}",
                f"finetune.data.task={TASK}",
                *steps(args.grpo_steps),
                "train.eval_every=100000",
                "finetune.eval_samples=0",
                *([f"optim.lr={args.grpo_lr}"] if args.grpo_lr else []),
                *seeded,
            ],
        ),
        "eval-grpo": ("eval", ["ckpt=${stage:grpo}", f"task={TASK}", *evaluated]),
    }
    if shared:
        del out["sft"], out["eval-sft"]
    for item in args.set:
        stage, _, override = item.partition(":")
        if stage in ("sft", "eval-sft") and shared:
            continue
        if stage not in out or "=" not in override:
            raise SystemExit(f"--set {item}: use STAGE:key=value with STAGE one of {', '.join(out)}")
        out[stage][1].append(override)
    return out


def write_pipeline(folder: Path, defs: dict[str, tuple[str, list[str]]]) -> Path:
    lines = [
        "# bench/posttrain.py: SFT, then DPO and GRPO from the same SFT model, each evaluated",
        "stages:",
    ]
    for name, (verb, argv) in defs.items():
        lines += [f"  {name}:", f"    verb: {verb}", f"    args: {json.dumps(argv)}"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "posttrain.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_seed(folder: Path) -> dict:
    """Exact match (%) of each trained stage and its wall time (s), from what `suite run` recorded."""
    try:
        data = json.loads((folder / "pipeline.json").read_text())
    except (OSError, ValueError):
        return {}
    seconds = {s["name"]: s.get("seconds") for s in data["stages"] if s.get("status") == "done"}
    row: dict = {}
    for stage in TRAINED:
        accuracy = data.get("figures", {}).get(stage, {}).get("accuracy")
        if accuracy is not None and f"eval-{stage}" in seconds:
            row[stage] = 100.0 * accuracy
        if stage in seconds:
            row[f"{stage}_s"] = seconds[stage]
    return row


def table(rows: dict[int, dict]) -> str:
    def cell(value: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = [
        "| seed | SFT EM % | DPO EM % | DPO gain | SimPO EM % | SimPO gain | GRPO EM % | GRPO gain "
        "| SFT / DPO / SimPO / GRPO wall (min) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    gains: dict[str, list[float]] = {stage: [] for stage in POST}
    for seed, row in sorted(rows.items()):
        gain = {}
        for stage in gains:
            if stage in row and "sft" in row:
                gain[stage] = row[stage] - row["sft"]
                gains[stage].append(gain[stage])
        walls = " / ".join(cell(row.get(f"{s}_s") and row[f"{s}_s"] / 60) for s in TRAINED)
        post = " | ".join(f"{cell(row.get(s))} | {cell(gain.get(s), '{:+.1f}')}" for s in POST)
        lines.append(f"| {seed} | {cell(row.get('sft'))} | {post} | {walls} |")
    for stage, values in gains.items():
        if values:
            mean = sum(values) / len(values)
            target = f" (target +{TARGETS[stage]:.0f} over 3 seeds)" if stage in TARGETS else ""
            lines.append(
                f"\n{stage.upper()}: mean gain {mean:+.1f} points over {len(values)} seed(s){target}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="runs/gpt-tiny", help="the pretrained model SFT starts from")
    parser.add_argument("--out", default="/tmp/posttrain", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--sft-seed",
        type=int,
        default=None,
        help="train SFT only in this seed's pipeline (run it first) and start every seed's DPO, SimPO and GRPO "
        "from that model (default: each seed trains its own)",
    )
    parser.add_argument("--sft-steps", type=int, default=None, help="default: sft-addition-tiny's")
    parser.add_argument("--dpo-steps", type=int, default=None, help="default: dpo-addition-tiny's")
    parser.add_argument("--simpo-steps", type=int, default=None, help="default: dpo-addition-tiny's")
    parser.add_argument("--grpo-steps", type=int, default=None, help="default: grpo-tiny's")
    parser.add_argument("--grpo-lr", default=None, help="optim.lr of GRPO (default: grpo-tiny's)")
    parser.add_argument("--eval-samples", type=int, default=200, help="held-out questions scored")
    parser.add_argument("--set", action="append", default=[], help="STAGE:key=value (repeatable)")
    parser.add_argument("--table", action="store_true", help="only print what finished in --out")
    args = parser.parse_args()
    rows = {}
    for seed in args.seeds:
        folder = args.out / f"seed-{seed}"
        if not args.table and args.sft_seed not in (None, seed) and not sft_folder(args).is_dir():
            raise SystemExit(
                f"--sft-seed {args.sft_seed}: no SFT model at {sft_folder(args)}; run that seed first"
            )
        if not args.table:
            recipe = write_pipeline(folder, stages(args, seed))
            argv = [sys.executable, "-m", "suite", "run", f"pipeline={recipe}", f"run.dir={folder / 'run'}"]
            print("$", " ".join(argv), flush=True)
            with open(folder / "run.log", "a") as log:
                code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
            if code != 0:
                print(f"seed {seed}: suite run exited {code}; see {folder / 'run.log'}", flush=True)
        rows[seed] = read_seed(folder / "run")
        if args.sft_seed is not None and seed != args.sft_seed:
            shared_sft = read_seed(sft_folder(args).parent).get("sft")
            if shared_sft is not None:
                rows[seed]["sft"] = shared_sft
        print(f"seed {seed}: {rows[seed]}", flush=True)
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "argv": sys.argv}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
