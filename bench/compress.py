"""Quantization acceptance, end to end with the real CLI: every PTQ method and QAT on a finetuned model.

    python bench/compress.py                                  # gpt and llama, all methods
    python bench/compress.py --families gpt --methods int8 int4 gptq --no-qat
    python bench/compress.py --runs /tmp/runs --out /tmp/compress-bench
    python bench/compress.py --base --methods int4 gptq   # the pretrained models instead
    python bench/compress.py --base --families gpt --methods int4 --qat-steps 100 --qat-set optim.lr=1e-4
    python bench/compress.py --families llama --no-qat               # llama-tiny only, no QAT arm
    python bench/compress.py --base --families llama --methods int4 --qat-steps 400 \
        --qat-set optim.lr=1e-4 sched.warmup_steps=5 compress.group_size=64 'compress.skip=[tok_embeddings]' \
        --set compress.group_size=64 'compress.skip=[tok_embeddings]'   # QAT and PTQ on another int4 grid

Per family (gpt: recipe gpt-tiny, llama: recipe llama-tiny), as a user would, each made only when its
folder is missing:
    suite pretrain recipe=<family>-tiny run.dir=<runs>/<family>-tiny             the base model
    suite finetune recipe=sft-tiny model=<family>-tiny model.init_from=<base> run.dir=<runs>/sft-<family>-tiny
then, for every method:
    suite quantize ckpt=<sft> compress=<method> run.dir=<out>/<family>-<method> compress.task_samples=200
and, unless --no-qat, quantization-aware training of the same finetune, converted to int4 at the end:
    suite finetune recipe=sft-tiny model=<family>-tiny ... compress=qat-int4 run.dir=<out>/<family>-qat
With --base the pretrained models are quantized instead, measured on their pretraining held-out
windows (a finetuned model nearly certain of every answer changes its perplexity too little to rank
methods by), and QAT is --qat-steps of continued pretraining (`suite pretrain model.init_from=<base>`)
with compress=qat-int4, against the same continued pretraining without it, quantized to int4 (--set
reaches every quantize, the continued arm's included; the QAT arm converts with its own compress keys,
so a grid other than the default goes in both --qat-set and --set). Every report (report.json) measures the same held-out rows: perplexity per assistant token on the
task's held-out questions, greedy exact match on all 200 of them, bytes on disk, decode tokens/s.
Prints one markdown table per family, the figures issue 17's acceptance names, and writes them to
<out>/results.json. Output folders that already hold a report are kept (delete one to redo it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METHODS = ["int8", "w8a8", "smoothquant", "int4", "gptq", "gptq-int8"]
REPORT = ["compress.task_samples=200", "compress.eval_batches=13", "log.progress=false"]


def suite(*args: str) -> float:
    start = time.perf_counter()
    print("$ suite " + " ".join(args), file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "suite", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"suite {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return time.perf_counter() - start


def finetuned(family: str, runs: Path) -> Path:
    base, sft = runs / f"{family}-tiny", runs / f"sft-{family}-tiny"
    if not (base / "checkpoints").exists():
        suite("pretrain", f"recipe={family}-tiny", f"run.dir={base}", "log.progress=false")
    if not (sft / "checkpoints").exists():
        suite(*_sft(family, base), f"run.dir={sft}")
    return sft


def _sft(family: str, base: Path) -> list[str]:
    return [
        "finetune",
        "recipe=sft-tiny",
        f"model={family}-tiny",
        f"model.init_from={base}",
        "log.progress=false",
    ]


def row(name: str, report: dict, bf16_block: float) -> dict:
    before, after = report["before"], report["after"]
    return {
        "method": name,
        "block_vs_bf16": bf16_block / after["block_bytes"],
        "file_bytes": after["file_bytes"],
        "ppl_before": before["perplexity"],
        "ppl_after": after["perplexity"],
        "ppl_change_pct": 100 * (after["perplexity"] / before["perplexity"] - 1),
        "acc_before": before.get("task_accuracy"),
        "acc_after": after.get("task_accuracy"),
        "acc_points": 100 * (after.get("task_accuracy", 0) - before.get("task_accuracy", 0)),
        "tok_s_before": before["decode_tokens_per_s"],
        "tok_s_after": after["decode_tokens_per_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--no-qat", action="store_true")
    parser.add_argument(
        "--base", action="store_true", help="quantize the pretrained model, not the finetuned"
    )
    parser.add_argument("--qat-steps", type=int, default=150, help="--base: steps of continued pretraining")
    parser.add_argument(
        "--qat-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="--base: overrides of both continued-pretraining arms, e.g. optim.lr=1e-4",
    )  # fmt: skip
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every quantize"
    )
    parser.add_argument("--runs", default="runs", help="where the base and finetuned models are (or go)")
    parser.add_argument("--out", default="runs/compress-bench")
    args = parser.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    results = {}
    for family in args.families:
        sft = finetuned(family, runs) if not args.base else runs / f"{family}-tiny"
        rows, reports = [], {}
        for method in args.methods:
            folder = out / f"{family}-{'base-' if args.base else ''}{method}"
            if not (folder / "report.json").exists():  # a finished quantization is kept
                suite(
                    "quantize", f"ckpt={sft}", f"compress={method}", f"run.dir={folder}", *REPORT, *args.set
                )
            reports[method] = json.loads((folder / "report.json").read_text())
        first = reports[args.methods[0]]
        bf16_block = first["before"]["block_bytes"] / 2  # the fp32 source's blocks, at 2 bytes a value
        bf16_file = first["before"]["file_bytes"] / 2
        for method in args.methods:
            rows.append(row(method, reports[method], bf16_block))
        if not args.no_qat and not args.base:
            qat = out / f"{family}-qat"
            suite(*_sft(family, runs / f"{family}-tiny"), "compress=qat-int4", f"run.dir={qat}", *REPORT[:2])
            report = json.loads((Path(f"{qat}-int4") / "report.json").read_text())
            report["before"] = first["before"]  # against the model finetuned without QAT
            rows.append(row("qat-int4", report, bf16_block))
        elif not args.no_qat:  # continued pretraining, with and without fake quantization
            ctrl, qat = out / f"{family}-base-continued", out / f"{family}-base-qat"
            more = [
                "pretrain", f"recipe={family}-tiny", f"model.init_from={sft}",
                f"train.max_steps={args.qat_steps}", "log.progress=false", *args.qat_set,
            ]  # fmt: skip
            if not (Path(f"{ctrl}-int4") / "report.json").exists():
                if not (ctrl / "checkpoints").exists():
                    suite(*more, f"run.dir={ctrl}")
                suite("quantize", f"ckpt={ctrl}", "compress=int4", f"run.dir={ctrl}-int4", *REPORT, *args.set)
            if not (Path(f"{qat}-int4") / "report.json").exists():
                suite(*more, "compress=qat-int4", f"run.dir={qat}", *REPORT[:2])
            ptq = json.loads((Path(f"{ctrl}-int4") / "report.json").read_text())
            report = json.loads((Path(f"{qat}-int4") / "report.json").read_text())
            report["before"] = ptq["before"]  # against the same continued pretraining without QAT
            rows.append(row("int4 (continued)", ptq, bf16_block))
            rows.append(row("qat-int4", report, bf16_block))
        results[family] = {
            "sft": str(sft),
            "bf16_block_bytes": bf16_block,
            "bf16_file_bytes": bf16_file,
            "rows": rows,
        }
        what = "pretrained (held-out windows)" if args.base else "finetuned on reverse-6"
        print(f"\n### {family}-tiny {what} ({sft})\n")
        print(
            f"bf16 reference: blocks {bf16_block / 1e6:.3f} MB, whole file {bf16_file / 1e6:.3f} MB (fp32 / 2)\n"
        )
        print(
            "| method | blocks vs bf16 | file MB | perplexity before -> after | change | exact match before -> after | points | decode tok/s before -> after |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            acc = (
                f"{100 * r['acc_before']:.1f}% -> {100 * r['acc_after']:.1f}%"
                if r["acc_after"] is not None
                else "n/a"
            )
            print(
                f"| {r['method']} | {r['block_vs_bf16']:.2f}x | {r['file_bytes'] / 1e6:.3f} | "
                f"{r['ppl_before']:.5f} -> {r['ppl_after']:.5f} | {r['ppl_change_pct']:+.3f}% | {acc} | "
                f"{r['acc_points']:+.1f} | {r['tok_s_before']:.0f} -> {r['tok_s_after']:.0f} |"
            )
        by = {r["method"]: r for r in rows}
        if "int4" in by and "gptq" in by:
            print(
                f"\ngptq int4 perplexity {by['gptq']['ppl_after']:.5f} vs round-to-nearest int4 {by['int4']['ppl_after']:.5f}"
            )
        ptq_row = by.get("int4 (continued)", by.get("int4"))
        if ptq_row and "qat-int4" in by:
            base = ptq_row["ppl_before"]
            ptq, qat_ppl = ptq_row["ppl_after"] - base, by["qat-int4"]["ppl_after"] - base
            share = (ptq - qat_ppl) / ptq if ptq else float("nan")
            print(
                f"QAT int4 recovers {100 * share:.1f}% of PTQ int4's perplexity increase ({ptq:+.5f} -> {qat_ppl:+.5f})"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results{'-base' if args.base else ''}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out}/results{'-base' if args.base else ''}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
