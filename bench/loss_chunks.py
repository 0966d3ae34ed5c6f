"""Time and peak memory of the output head + loss, plain vs chunked (train.loss_chunk_tokens), on CPU.

Each setting runs in its own process (peak RSS is per process): forward + backward of
`hidden @ weight.T` and the fp32 cross-entropy over batch x seq tokens, median of --reps; CPU s is the
process's CPU time, steadier than wall time on a shared machine (run with OMP_NUM_THREADS=1).
    python bench/loss_chunks.py --vocab 32000 --width 768 --tokens 2048 --chunks 0 512 1024 2048
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(vocab: int, width: int, tokens: int, chunk: int, precision: str, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from suite.train.loss import chunked_cross_entropy

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, width, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=gen)
    dtype = torch.bfloat16 if precision == "bf16" else None
    times, cpu_times = [], []
    for _ in range(reps + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            if chunk:
                loss = chunked_cross_entropy(hidden, weight, targets, chunk)
            else:
                logits = F.linear(hidden, weight)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        hidden.grad = weight.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {
        "chunk": chunk,
        "s": statistics.median(times[1:]),
        "cpu_s": statistics.median(cpu_times[1:]),
        "peak_gb": peak / 1024**2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.vocab, args.width, args.tokens, args.child, args.precision, args.reps)))
        return
    print(
        f"vocab {args.vocab}, width {args.width}, {args.tokens} tokens, {args.precision}, median of {args.reps}"
    )
    print("| loss_chunk_tokens | fwd+bwd s | CPU s | peak mem GB |\n|---:|---:|---:|---:|")
    for chunk in args.chunks:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(chunk)]
        row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        print(
            f"| {chunk or 'off'} | {row['s']:.3f} | {row['cpu_s']:.3f} | {row['peak_gb']:.2f} |", flush=True
        )


if __name__ == "__main__":
    main()
