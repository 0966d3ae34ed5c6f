"""Pruning acceptance, end to end with the real CLI: prune a finetuned model, heal it by distillation
from the model it came from, score it, export it.

    python bench/prune.py --runs /tmp/runs                  # gpt and llama, finetuned by bench/compress.py
    python bench/prune.py --families llama --heal-steps 300
    python bench/prune.py --hidden 0.25 --out /tmp/prune-h    # hidden channels with the heads: exportable

Per family (the finetuned model <runs>/sft-<family>-tiny that bench/compress.py makes), as a user would:
    suite prune ckpt=<sft> prune.ffn=0.25 prune.heads=0.25 run.dir=<out>/<family>-pruned
    suite distill recipe=distill-sft-tiny distill.teacher=<sft> model.init_from=<out>/<family>-pruned
        train.max_steps=<heal-steps> run.dir=<out>/<family>-healed        (a short distillation)
    suite eval ckpt=<sft>, ckpt=<pruned>, ckpt=<healed>                      exact match, 200 questions
    suite export ckpt=<healed> out=<out>/<family>-hf                         when the family's HF config
                                                                           holds the pruned heads
and compares transformers' logits of the export with the suite's on a held-out batch. Prints a
markdown table and writes <out>/prune-results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def suite(*args: str, check: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    print("$ suite " + " ".join(args), file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "suite", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"suite {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc, time.perf_counter() - start


def exact_match(ckpt: Path) -> float:
    proc, _ = suite("eval", f"ckpt={ckpt}", "--json")
    return json.loads(proc.stdout.strip().splitlines()[-1])["accuracy"]


def params(run: Path) -> int:
    from suite.config.compose import load_saved_config
    from suite.models import build_model

    model = build_model(load_saved_config(run / "config.yaml").model, "meta")
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def hf_logit_error(run: Path, hf: Path) -> float:
    """Max |transformers' logits - the suite's| on 2 x 64 tokens of the vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    from suite.model_source import ModelSource

    ours = ModelSource.parse(str(run)).load_model().eval()
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((theirs(ids).logits - ours(ids)).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--runs", default="runs", help="holds sft-<family>-tiny (bench/compress.py makes it)")
    parser.add_argument("--out", default="runs/prune-bench")
    parser.add_argument("--heal-steps", type=int, default=200)
    parser.add_argument("--ffn", type=float, default=0.25)
    parser.add_argument("--heads", type=float, default=0.25)
    parser.add_argument("--hidden", type=float, default=0.0, help="prune.hidden (= --heads keeps HF export)")
    args = parser.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    results = {}
    for family in args.families:
        sft = runs / f"sft-{family}-tiny"
        pruned, healed, hf = out / f"{family}-pruned", out / f"{family}-healed", out / f"{family}-hf"
        if not (pruned / "checkpoints").exists():
            suite(
                "prune", f"ckpt={sft}", f"prune.ffn={args.ffn}", f"prune.heads={args.heads}", f"prune.hidden={args.hidden}", f"run.dir={pruned}",
                "compress.task_samples=0",
            )  # fmt: skip
        heal_wall = None
        if not (healed / "checkpoints").exists():
            _, heal_wall = suite(
                "distill", "recipe=distill-sft-tiny", f"distill.teacher={sft}", f"model.init_from={pruned}",
                f"train.max_steps={args.heal_steps}", f"run.dir={healed}", "train.overwrite=true",
                "log.progress=false",
            )  # fmt: skip
        row = {
            "params": {"teacher": params(sft), "pruned": params(pruned)},
            "exact_match": {
                name: exact_match(run)
                for name, run in (("teacher", sft), ("pruned", pruned), ("healed", healed))
            },
            "heal_steps": args.heal_steps,
            "heal_wall_s": heal_wall,
        }
        proc, _ = suite("export", f"ckpt={healed}", f"out={hf}", check=False)
        if proc.returncode == 0:
            row["hf_max_abs_logit_error"] = hf_logit_error(healed, hf)
        else:
            row["hf_export"] = proc.stderr.strip().splitlines()[-1]
        row["kept_fraction"] = row["exact_match"]["healed"] / row["exact_match"]["teacher"]
        results[family] = row
    print(
        "\n| model | parameters | exact match: source -> pruned -> healed (heal steps) | kept | HF export |"
    )
    print("|---|---:|---:|---:|---|")
    for family, r in results.items():
        em = r["exact_match"]
        export = (
            f"transformers' logits within {r['hf_max_abs_logit_error']:.1e}"
            if "hf_max_abs_logit_error" in r
            else f"refused: {r['hf_export'][:80]}"
        )
        print(
            f"| {family}-tiny sft, ffn {args.ffn} + heads {args.heads} + hidden {args.hidden} | {r['params']['teacher']:,} -> "
            f"{r['params']['pruned']:,} | {100 * em['teacher']:.1f}% -> {100 * em['pruned']:.1f}% -> "
            f"{100 * em['healed']:.1f}% ({r['heal_steps']}) | {100 * r['kept_fraction']:.1f}% | {export} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "prune-results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out / 'prune-results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
