"""GPTQ on a real checkpoint (issue 43): held-out perplexity before and after compress=gptq with its
default settings (or `--set key=value` over them), quantize time, and llama.cpp's Q4_0 of the same
weights on the same windows.

    python bench/gptq_real.py --gguf .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf --llama-cpp-q4_0
    python bench/gptq_real.py --gguf ... --set act_order=false --set clip_weighted=false  # an A/B
    python bench/gptq_real.py --gguf ... --set int8_layers=12      # mixed precision
    python bench/gptq_real.py --gguf ... --calib 4 --forwards      # the old way (re-run per block)
    python bench/gptq_real.py --gguf ... --no-ppl --keep-denormals  # without flush_denormals (A/B)

`--set` takes any compress.* key compress=gptq reads (suite/config/schema.py's defaults otherwise);
the sections of docs/benchmarks.md before 2026-11-29 07:30 UTC ran an older form of this script
whose `--grid symmetric|asymmetric` and `--clip-search` are `--set symmetric=...`, `--set
clip_search=...` here (with act_order=false clip_weighted=false, which that code did not have).

Calibration: `--calib` windows of `--seq` tokens of the licence texts in /usr/share/common-licenses
(all but GPL-3); held out: the first `--held` windows of GPL-3. Weights dequantized to fp32,
compress.skip's default (embedding and tied head stay float). `--llama-cpp-q4_0`: the weights written
as `suite export format=gguf export.quantize=q4_0` writes them (suite.export.gguf.write_gguf; the tied
head/embedding Q8_0), then perplexity from llama.cpp's logits (llama-cpp-python, logits_all) on the
same token ids, and from the suite reading that file back (`gguf:`); `q4_0_token_ids` compares
llama.cpp's tokenization of GPL-3 with the suite's (they differ on whitespace runs:
docs/benchmarks.md). Prints one JSON line: seconds in quantization (the int8_layers measurement and
gptq_quantize), perplexities, bits per block weight, CPU, threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LICENCES = Path("/usr/share/common-licenses")


def windows(tokenizer, texts: list[str], seq: int, count: int) -> list[torch.Tensor]:
    ids = [i for text in texts for i in tokenizer.encode(text)]
    return [torch.tensor([ids[k * seq : (k + 1) * seq]]) for k in range(min(count, len(ids) // seq))]


def nll(logits: torch.Tensor, row: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of `row` [1, T] given `logits` [T, vocab]."""
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), row[0, 1:], reduction="sum"))


@torch.no_grad()
def perplexity(model, rows: list[torch.Tensor]) -> float:
    total = sum(nll(model(row)[0], row) for row in rows)
    return math.exp(total / sum(row.shape[1] - 1 for row in rows))


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line),
        platform.processor(),
    )


def overrides(pairs: list[str]) -> dict:
    """--set key=value over CompressConfig's fields, typed as the field's default."""
    from suite.config.schema import CompressConfig

    defaults = {f.name: getattr(CompressConfig(), f.name) for f in dataclasses.fields(CompressConfig)}
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in defaults:
            raise SystemExit(f"--set {pair}: compress.{key} is not a compress key")
        kind = type(defaults[key])
        out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return out


def block_bits(model, targets: list[str]) -> float:
    """Bits per block weight once packed: int4 values and zero points 4 bits, int8 values 8, scales
    at their dtype (what llama.cpp's Q4_0, 4.5, is measured against; the stored torchao tensors
    hold one int8 per value)."""
    modules = dict(model.named_modules())
    bits = count = 0
    for name in targets:
        w = modules[name].weight
        n = w.shape[0] * w.shape[1]
        four = type(w).__name__ == "IntxUnpackedToInt8Tensor"
        zero = getattr(w, "zero_point", None)
        bits += n * (4 if four else 8) + 8 * w.scale.numel() * w.scale.element_size()
        bits += 4 * zero.numel() if four and zero is not None and bool(zero.any()) else 0
        count += n
    return bits / count


def llama_cpp_q4_0(source, held: list[torch.Tensor], text: str, suite_ids: list[int], threads: int) -> dict:
    """llama.cpp's Q4_0 of `source`'s weights (the suite's own export): perplexity on `held` from
    llama.cpp's logits and from the suite reading the file back; its bits per block weight."""
    # deferred: llama-cpp-python and gguf are optional (the deploy extra)
    from gguf import GGUFReader
    from llama_cpp import Llama

    from suite.export.gguf import write_gguf
    from suite.model_source import ModelSource

    seq = held[0].shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path, _ = write_gguf(source, Path(tmp), "q4_0")
        export_s = time.perf_counter() - start
        blocks = [t for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.") and len(t.shape) > 1]
        bits = 8 * sum(int(t.n_bytes) for t in blocks) / sum(int(np.prod(t.shape)) for t in blocks)
        llm = Llama(
            str(path), n_ctx=seq, n_batch=seq, n_ubatch=seq, logits_all=True, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        total = 0.0
        for row in held:
            llm.reset()
            llm.eval(row[0].tolist())
            total += nll(torch.from_numpy(np.array(llm.scores[:seq])), row)
        del llm
        read_back = ModelSource.parse(f"gguf:{path}").load_model().eval()
        suite_ppl = perplexity(read_back, held)
        file_bytes = path.stat().st_size
    count = sum(row.shape[1] - 1 for row in held)
    return {
        "q4_0_llama_cpp_ppl": math.exp(total / count),
        "q4_0_suite_read_ppl": suite_ppl,
        "q4_0_token_ids": {  # GPL-3 in llama.cpp's tokenizer against the suite's
            "suite": len(suite_ids),
            "llama_cpp": len(ids),
            "first_difference": next((i for i, (a, b) in enumerate(zip(ids, suite_ids)) if a != b), None),
        },
        "q4_0_file_bytes": file_bytes,
        "q4_0_block_bits": round(bits, 3),
        "q4_0_export_seconds": round(export_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--calib", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--held", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a compress.* key")
    parser.add_argument("--llama-cpp-q4_0", action="store_true", help="llama.cpp's Q4_0 of the same weights")
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
    args = parser.parse_args()
    if args.keep_denormals:  # this process only: flush_denormals' switch does nothing
        torch.set_flush_denormal = lambda on: True

    from suite.compress.methods import linear_plan
    from suite.config.schema import CompressConfig
    from suite.model_source import ModelSource
    from suite.models import gptq
    from suite.models.compression import get
    from suite.models.gptq import gptq_quantize

    if args.forwards_only:  # the per-column GPTQ update skipped: what caching the block inputs changes
        gptq._quantize_linears = lambda *a, **k: None
        gptq.store_values = lambda *a, **k: None

    compress = CompressConfig(method="gptq", **overrides(args.set))
    method = get("gptq")
    settings = method.settings(compress)
    source = ModelSource.parse(f"gguf:{args.gguf}")
    tokenizer, model = source.tokenizer(), source.load_model().eval()
    calib_texts = [p.read_text() for p in sorted(LICENCES.glob("*")) if p.is_file() and p.name != "GPL-3"]
    calib = windows(tokenizer, calib_texts, args.seq, args.calib)
    held_text = (LICENCES / "GPL-3").read_text()
    held = windows(tokenizer, [held_text], args.seq, args.held)
    before = None if args.no_ppl else perplexity(model, held)
    q4_0 = {}
    if args.llama_cpp_q4_0:
        q4_0 = llama_cpp_q4_0(
            source,
            held,
            held_text,
            tokenizer.encode(held_text, add_special_tokens=False),
            torch.get_num_threads(),
        )
    targets, _ = linear_plan(model, compress.skip)

    def calibrate(m):
        for row in calib:
            m(row)

    start = time.perf_counter()
    wide = method.wide(model, targets, compress, calibrate)
    gptq_quantize(
        model,
        targets,
        method.grid(compress),
        settings.gptq_damp,
        calibrate,
        cache_inputs=not args.forwards,
        progress=True,
        int8_layers=wide,
        act_order=settings.act_order,
    )
    seconds = time.perf_counter() - start
    after = None if args.no_ppl else perplexity(model, held)
    print(json.dumps({
        "model": Path(args.gguf).name, "precision": "fp32 (dequantized), compress=gptq",
        "compress": {k: v for k, v in dataclasses.asdict(settings).items() if k != "calib_samples"},
        "mode": "forwards from the embedding" if args.forwards else "cached block inputs",
        "calib": f"{len(calib)} x {args.seq}", "held_out": f"{len(held)} x {args.seq}",
        "gptq_seconds": round(seconds, 1), "forwards_only": args.forwards_only,
        "denormals": "kept" if args.keep_denormals else "flushed", "ppl_before": before, "ppl_after": after,
        "vs_fp32": None if args.no_ppl else f"{100 * (after / before - 1):+.3f}%",
        "block_bits": None if args.forwards_only else round(block_bits(model, targets), 3), **q4_0,
        "cpu": cpu_name(), "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
