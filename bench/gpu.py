#!/usr/bin/env python
"""Tokens/s, MFU and allocator memory of the suite's training step on one CUDA GPU, each option on
and off.

    python bench/gpu.py                                  # gpt345m, gpt1.3b, llama3-8b (layers reduced)
    python bench/gpu.py --models gpt345m --steps 5 --quick
    python bench/gpu.py --append                         # also append the table to docs/benchmarks.md
    python bench/gpu.py --llama-layers 12                # more Llama-3-8B layers (a bigger GPU)
    python bench/gpu.py --models gpt1.3b --variants base --set parallel.micro_batch_size=8
    python bench/gpu.py --deadline 300 --json rows.json  # stop starting rows after 300 s; rows as JSON

Models: `model=gpt345m`, `model=gpt1.3b`, and `model=llama3-8b` with `model.num_layers` reduced to
`--llama-layers` (default 8: its full 32 layers with fp32 AdamW state need ~130 GB, more than one
GPU holds); the table says so. Every row is the trainer's own step (suite.train.trainer.standalone_step:
parallelize, materialise, the optimizer, the step) on random tokens, built in a fresh process so
each row's compile caches and peak memory are its own. Rows, each one option away from `base`:

    base        train.precision=bf16, train.compile=true, SDPA with the flash backend
    fp8         train.precision=fp8 (torchao float8 linears; needs compute capability 8.9+)
    eager       train.compile=false
    math-sdpa   SDPA restricted to the math backend (torch.nn.attention.sdpa_kernel)
    cudnn-sdpa  SDPA restricted to cuDNN's attention (Hopper's fastest causal kernel in recent torch)
    offload     parallel.offload=true in one process (FSDP2 CPUOffloadPolicy: state in host memory)
    bf16-params train.param_dtype=bf16 (bf16 parameters and gradients, AdamW on fp32 master copies)
    no-loss-chunks  train.loss_chunk_tokens=0 (the head and cross-entropy over all logits at once)
    foreach-adamw   optim.fused=false (the multi-tensor AdamW instead of the fused kernel)
    fsdp2 / fsdp2+offload   parallel.sharding=2 (stage 3) without / with parallel.offload=true, through
                `suite pretrain` on the embedded corpus (2 processes: needs 2 GPUs, else not run)

tokens/s: median over `--steps` timed steps after `--warmup` steps (compile happens in the warm-up);
a step is the optimizer step: parallel.global_batch_size / parallel.micro_batch_size micro-batches
(1 unless `--set parallel.global_batch_size=...`), so accumulation amortises AdamW as in training.
MFU: tokens/s x suite.models.flops_per_token / the device's data-sheet dense bf16 peak
(suite.train.peak_flops; an fp8 row is against the bf16 peak too, so rows compare). A device the table
lacks prints no MFU. Memory: torch.cuda.max_memory_allocated / max_memory_reserved over the timed
steps. Without CUDA the script exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {  # name -> (model group option, seq_len, micro batch)
    "gpt345m": ("gpt345m", 1024, 8),
    "gpt1.3b": ("gpt1.3b", 2048, 4),
    "llama3-8b": ("llama3-8b", 2048, 1),
}
VARIANTS = {  # name -> (overrides, SDPA backend)
    "base": ([], "flash"),
    "fp8": (["train.precision=fp8"], "flash"),
    "eager": (["train.compile=false"], "flash"),
    "math-sdpa": ([], "math"),
    "cudnn-sdpa": ([], "cudnn"),
    "offload": (["parallel.offload=true"], "flash"),
    "bf16-params": (["train.param_dtype=bf16"], "flash"),
    "no-loss-chunks": (["train.loss_chunk_tokens=0"], "flash"),
    "foreach-adamw": (["optim.fused=false"], "flash"),
}
MULTI_GPU = ("fsdp2", "fsdp2+offload")


def overrides_for(model: str, llama_layers: int, seq: int, micro: int) -> list[str]:
    option = MODELS[model][0]
    out = [
        f"model={option}",
        "train.precision=bf16",
        "train.compile=true",
        "train.device=cuda",
        "model.attention=sdpa",
        f"data.seq_len={seq}",
        f"model.max_seq_len={max(seq, 1024)}",
        f"parallel.micro_batch_size={micro}",
        f"parallel.global_batch_size={micro}",
        "log.wandb=false",
        "log.progress=false",
    ]
    if model == "llama3-8b":
        out.append(f"model.num_layers={llama_layers}")
    return out


def one_row(model: str, variant: str, args) -> dict:
    """Build and time one (model, variant) in this process; returns the row's numbers."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from suite.config.compose import compose_config, to_object
    from suite.data.batch import Batch
    from suite.models import flops_per_token
    from suite.preflight import validate
    from suite.runtime import resolve_auto
    from suite.train.peak_flops import cuda_memory_stats, peak_flops
    from suite.train.trainer import standalone_step

    _, seq, micro = MODELS[model]
    seq, micro = args.seq_len or seq, args.micro_batch or micro
    extra, backend = VARIANTS[variant]
    overrides = overrides_for(model, args.llama_layers, seq, micro) + extra + list(args.set)
    cfg = to_object(resolve_auto(compose_config(overrides)))
    seq, micro = cfg.data.seq_len, cfg.parallel.micro_batch_size  # --set may change them
    dims = validate(cfg, needs_data=False, writes_run=False)
    device = torch.device("cuda", 0)
    kernel = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    gen = torch.Generator().manual_seed(0)
    accumulation = dims.accumulation(cfg.parallel)  # micro-batches per optimizer step (global batch / micro)
    batches = [
        Batch.from_windows(torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=gen).to(device))
        for _ in range(accumulation)
    ]
    with sdpa_kernel(kernel):
        start = time.perf_counter()
        step = standalone_step(cfg, dims, device)
        for _ in range(args.warmup):
            step(batches, cfg.optim.lr)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(batches, cfg.optim.lr)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    tokens_per_s = accumulation * micro * seq / statistics.median(times)
    peak = peak_flops(device, cfg.train.precision, cfg.train.peak_flops)
    fpt = flops_per_token(cfg.model, seq)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * fpt / peak if peak else None,
        "warmup_s": warmup_s,
        "layers": cfg.model.num_layers,
        "seq": seq,
        "micro": micro,
        "accumulation": accumulation,
        "flops_per_token": fpt,
        **cuda_memory_stats(device),
    }


def fsdp_row(model: str, offload: bool, args) -> dict:
    """parallel.sharding=2 (offload on/off) through `suite pretrain` on 2 GPUs; numbers from its metrics."""
    import tempfile

    _, seq, micro = MODELS[model]
    seq, micro = args.seq_len or seq, args.micro_batch or micro
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "suite",
            "pretrain",
            *overrides_for(model, args.llama_layers, seq, micro),
        ]
        cmd += [
            f"parallel.global_batch_size={2 * micro}",
            "parallel.sharding=2",
            "parallel.sharding_stage=3",
            f"parallel.offload={str(offload).lower()}",
            "launch.nproc_per_node=2",
            f"train.max_steps={args.warmup + args.steps}",
            f"train.log_every={args.steps}",
            "train.eval_every=1000000",
            "train.save_every=1000000",
            f"run.dir={tmp}/run",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.row_timeout)
        if proc.returncode:
            tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
            return {"error": tail[:200]}
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "tokens_per_s" in r][-1]
    keys = ("tokens_per_s", "mfu", "mem_allocated_gb", "mem_reserved_gb")
    return {k: last.get(k) for k in keys} | {"seq": seq, "micro": micro, "per_gpu": True}


def run_row(model: str, variant: str, args) -> dict:
    """One row in a fresh process (its own compile caches and peak memory); an error is a row too."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", model, variant]
    cmd += [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--llama-layers",
        str(args.llama_layers),
    ]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.micro_batch:
        cmd += ["--micro-batch", str(args.micro_batch)]
    if args.set:
        cmd += ["--set", *args.set]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.row_timeout}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": tail[:200]}
    return json.loads(lines[-1])


def table(results: list[tuple[str, str, dict]], args) -> str:
    out = [
        "| model | variant | tokens/s | MFU | max allocated GiB | max reserved GiB | warm-up s | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for model, variant, r in results:
        if "error" in r:
            out.append(f"| {model} | {variant} | - | - | - | - | - | not run: {r['error']} |")
            continue
        note = f"seq {r.get('seq')}, micro batch {r.get('micro')}"
        if r.get("accumulation", 1) > 1:
            note += f" x {r['accumulation']} accumulated per optimizer step"
        if model == "llama3-8b":
            note += f", {args.llama_layers} of 32 layers (to fit one GPU)"
        if r.get("per_gpu"):
            note += ", 2 GPUs (tokens/s of the job)"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a (no tabled peak)"

        def num(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if r.get(key) is not None else "-"

        out.append(
            f"| {model} | {variant} | {num('tokens_per_s', ',.0f')} | {mfu} | {num('mem_allocated_gb', '.1f')} | "
            f"{num('mem_reserved_gb', '.1f')} | {num('warmup_s', '.0f')} | {note} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--variants", nargs="+", default=[*VARIANTS, *MULTI_GPU], choices=[*VARIANTS, *MULTI_GPU]
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--llama-layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="override every model's sequence length")
    parser.add_argument("--micro-batch", type=int, default=None, help="override every model's micro batch")
    parser.add_argument("--row-timeout", type=int, default=900)
    parser.add_argument("--quick", action="store_true", help="2 timed steps, 1 warm-up, seq 512")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every one-GPU row"
    )
    parser.add_argument("--deadline", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--append", action="store_true", help="append the table to docs/benchmarks.md")
    parser.add_argument("--row", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            f"bench/gpu.py needs a CUDA GPU; this machine has none (torch {torch.__version__}, "
            "torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.steps, args.warmup, args.seq_len = 2, 1, args.seq_len or 512
    if args.row:
        print(json.dumps(one_row(*args.row, args)), flush=True)
        return 0

    device = torch.cuda.get_device_name(0)
    started = datetime.now(timezone.utc)
    results = []
    t0 = time.monotonic()
    for model in args.models:
        for variant in args.variants:
            if args.deadline is not None and time.monotonic() - t0 > args.deadline:
                row = {"error": f"not started: past --deadline {args.deadline:.0f}s"}
            elif variant in MULTI_GPU:
                if torch.cuda.device_count() < 2:
                    row = {"error": "parallel.sharding=2 needs 2 GPUs"}
                else:
                    row = fsdp_row(model, variant.endswith("offload"), args)
            else:
                row = run_row(model, variant, args)
            print(f"{model} {variant}: {json.dumps(row)}", file=sys.stderr, flush=True)
            results.append((model, variant, row))
            if args.json:
                rows = [{"model": m, "variant": v, "device": device, **r} for m, v, r in results]
                args.json.write_text(json.dumps(rows, indent=1))
    text = table(results, args)
    command = "python bench/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"## One GPU ({device}, torch {torch.__version__}), {started:%Y-%m-%d %H:%M} UTC: `{command.strip()}`\n\n"
        f"{args.steps} timed steps after {args.warmup} warm-up steps per row, each row in its own process; "
        "MFU against the data-sheet dense bf16 peak.\n\n"
    )
    print(header + text)
    if args.append:
        with open(ROOT / "docs" / "benchmarks.md", "a") as fh:
            fh.write("\n" + header + text + "\n")
        print("appended to docs/benchmarks.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
