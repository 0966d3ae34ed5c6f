"""GPTQ on a real checkpoint (issue 43): quantize time with cached block inputs against the old
forwards from the embedding, and held-out perplexity before and after.

    python bench/gptq_real.py --gguf .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf --calib 32
    python bench/gptq_real.py --gguf ... --calib 4 --forwards     # the old way (re-run per block)
    python bench/gptq_real.py --gguf ... --no-ppl --keep-denormals  # without flush_denormals (A/B)
    python bench/gptq_real.py --gguf ... --grid asymmetric          # int4 with integer zero points
    python bench/gptq_real.py --gguf ... --grid asymmetric --clip-search  # compress=gptq's defaults

Calibration: `--calib` windows of `--seq` tokens of the licence texts in /usr/share/common-licenses
(all but GPL-3); held out: the first `--held` windows of GPL-3. Weights dequantized to fp32, int4
group 32 (compress=gptq's defaults), compress.skip's default (embedding and tied head stay float).
Prints one JSON line: seconds in gptq_quantize, perplexity before/after, CPU, threads.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch

LICENCES = Path("/usr/share/common-licenses")


def windows(tokenizer, texts: list[str], seq: int, count: int) -> list[torch.Tensor]:
    ids = [i for text in texts for i in tokenizer.encode(text)]
    return [torch.tensor([ids[k * seq : (k + 1) * seq]]) for k in range(min(count, len(ids) // seq))]


@torch.no_grad()
def perplexity(model, rows: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for row in rows:
        logits = model(row)[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits, row[0, 1:], reduction="sum"))
        count += row.shape[1] - 1
    return math.exp(total / count)


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line),
        platform.processor(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--calib", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--held", type=int, default=8)
    parser.add_argument("--forwards", action="store_true", help="the old way: forwards from the embedding")
    parser.add_argument("--no-ppl", action="store_true")
    parser.add_argument(
        "--forwards-only",
        action="store_true",
        help="time the calibration forwards and Hessians only (weights kept)",
    )
    parser.add_argument(
        "--keep-denormals",
        action="store_true",
        help="GPTQ without flushing denormal floats to zero (what suite.models.gptq.flush_denormals changes)",
    )
    parser.add_argument(
        "--grid",
        choices=["symmetric", "asymmetric"],
        default="symmetric",
        help="int4 grid: zero points 0, or per-group integer zero points (compress.symmetric=false)",
    )
    parser.add_argument(
        "--clip-search", action="store_true", help="asymmetric: compress.clip_search=true (the default)"
    )
    args = parser.parse_args()
    if args.keep_denormals:  # this process only: flush_denormals' switch does nothing
        torch.set_flush_denormal = lambda on: True

    from suite.compress.methods import linear_plan
    from suite.config.schema import CompressConfig
    from suite.model_source import ModelSource
    from suite.models import gptq
    from suite.models.gptq import gptq_quantize, int4_grid

    if args.forwards_only:  # the per-column GPTQ update skipped: what caching the block inputs changes
        gptq._quantize_linears = lambda linears, hessians, grid, damp, results: None
        gptq.store_values = lambda *a, **k: None

    source = ModelSource.parse(f"gguf:{args.gguf}")
    tokenizer, model = source.tokenizer(), source.load_model()
    calib_texts = [p.read_text() for p in sorted(LICENCES.glob("*")) if p.is_file() and p.name != "GPL-3"]
    calib = windows(tokenizer, calib_texts, args.seq, args.calib)
    held = windows(tokenizer, [(LICENCES / "GPL-3").read_text()], args.seq, args.held)
    before = None if args.no_ppl else perplexity(model, held)
    targets, _ = linear_plan(model, CompressConfig().skip)

    def calibrate(m):
        for row in calib:
            m(row)

    start = time.perf_counter()
    gptq_quantize(
        model,
        targets,
        int4_grid(32, args.grid == "symmetric", args.clip_search),
        0.01,
        calibrate,
        cache_inputs=not args.forwards,
        progress=True,
    )
    seconds = time.perf_counter() - start
    after = None if args.no_ppl else perplexity(model, held)
    print(json.dumps({
        "model": Path(args.gguf).name, "precision": f"fp32 (dequantized), int4 g32 {args.grid}{' clipped' if args.clip_search else ''} gptq",
        "mode": "forwards from the embedding" if args.forwards else "cached block inputs",
        "calib": f"{len(calib)} x {args.seq}", "held_out": f"{len(held)} x {args.seq}",
        "gptq_seconds": round(seconds, 1), "forwards_only": args.forwards_only,
        "denormals": "kept" if args.keep_denormals else "flushed", "ppl_before": before, "ppl_after": after,
        "cpu": cpu_name(), "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
