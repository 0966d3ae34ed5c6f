"""Peak memory and time of attention over packed documents: per-document SDPA vs the dense mask.

`model.document_attention` = varlen (one causal SDPA per document) or dense (the [b, 1, S, S] boolean
mask handed to SDPA). For each sequence length, a row of `--docs` documents (random lengths, fixed
seed) goes through one CoreAttention forward + backward (the model's own module, fp32, GQA). Each
(path, length) runs in its own process. Reported per run:

- peak attention memory: the highest live tensor memory during forward + backward (torch's
  MemTracker, which sees every tensor storage on CPU), minus Q/K/V and the output gradient (the
  inputs both paths share); the dense path's mask is counted, it is part of that path;
- peak RSS growth of the process over the same span (the allocator's view, for a cross-check);
- fwd+bwd wall seconds (one timed call after the measured one) and the largest output difference
  from the dense path (same inputs, same seed).

With --cp N the same attention runs context parallel (suite.parallel.context_parallel) over N gloo
processes, each holding its two load-balanced chunks of Q/K/V; the figures are the largest rank's
(its peak includes the transiently gathered K/V of the whole sequence, which both paths share).

    python bench/document_attention.py --seqs 2048 4096 8192 --docs 8 --heads 8 --kv-heads 2 --head-dim 64 [--cp 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

MIB = 2**20


def document_lengths(seq: int, docs: int, seed: int = 0) -> list[int]:
    import torch

    cuts = torch.randperm(seq - 1, generator=torch.Generator().manual_seed(seed))[: docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), seq]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _tensors(seq: int, docs: int, heads: int, kv_heads: int, head_dim: int):
    """(document lengths, doc_ids [1, seq], q, k, v, output gradient), the same in every process."""
    import torch

    lengths = document_lengths(seq, docs)
    doc_ids = torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths))[None]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, seq, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, heads, seq, head_dim, generator=gen)
    return lengths, doc_ids, q, k, v, grad


def _measure(attention, q, k, v, grad, documents) -> tuple[dict, object]:
    """Peak tracked memory (less the inputs), RSS growth and time of one forward + backward."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))

    def step() -> torch.Tensor:
        out = attention(q, k, v, documents())
        out.backward(grad)
        return out.detach()

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracker = MemTracker()
    tracker.track_external(q, k, v, grad)
    with tracker:
        out = step()
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda d: d.get("Total", 0))["Total"]
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, grad))
    for t in (q, k, v):
        t.grad = None
    start = time.perf_counter()
    step()
    return {"peak": peak - inputs, "rss": rss_growth, "s": time.perf_counter() - start}, out


def _cp_worker(rank: int, cp: int, port: int, path: str, shape: tuple, queue) -> None:
    import os

    import torch
    import torch.distributed as dist

    from suite.models.document_attention import Documents
    from suite.parallel.context_parallel import ContextParallelAttention, chunk_index

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        seq, _, heads, kv_heads, _ = shape
        _, doc_ids, q, k, v, grad = _tensors(*shape)
        index = chunk_index(seq, cp, rank)
        local = [t[:, :, index].contiguous() for t in (q, k, v, grad)]
        attention = ContextParallelAttention(heads != kv_heads, dist.group.WORLD, cp, rank)
        row, out = _measure(attention, *local, lambda: Documents(doc_ids, dense=path == "dense"))
        torch.save(out, f"/tmp/document_attention_{path}_{seq}_cp{cp}_rank{rank}.pt")
        queue.put(row)
    finally:
        dist.destroy_process_group()


def one(path: str, seq: int, docs: int, heads: int, kv_heads: int, head_dim: int, cp: int) -> dict:
    """One path at one length: the model's CoreAttention (cp=1), or its context-parallel attention over
    cp gloo processes (the largest rank's peak)."""
    import torch

    from suite.models.document_attention import Documents
    from suite.models.transformer import CoreAttention

    shape = (seq, docs, heads, kv_heads, head_dim)
    lengths, doc_ids, q, k, v, grad = _tensors(*shape)
    if cp == 1:
        row, out = _measure(
            CoreAttention(heads, kv_heads), q, k, v, grad, lambda: Documents(doc_ids, path == "dense")
        )
        torch.save(out, f"/tmp/document_attention_{path}_{seq}_cp1_rank0.pt")
        return {**row, "lengths": lengths}
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_cp_worker, args=(cp, port, path, shape, queue), nprocs=cp, start_method="spawn")
    rows = [queue.get() for _ in range(cp)]
    return {key: max(r[key] for r in rows) for key in ("peak", "rss", "s")} | {"lengths": lengths}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel processes (gloo); 1: one process")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.docs, args.heads, args.kv_heads, args.head_dim)
    if args.child is not None:
        print(json.dumps(one(args.child[0], int(args.child[1]), *shape, args.cp)))
        return
    import platform

    import torch

    print(
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; batch 1, "
        f"{args.heads} heads ({args.kv_heads} kv), head_dim {args.head_dim}, {args.docs} documents per row, "
        f"cp={args.cp}" + (" (the largest rank's figures)" if args.cp > 1 else "")
    )
    print(
        "| seq | document lengths | varlen peak MiB | dense peak MiB | varlen / dense | varlen RSS growth MiB "
        "| dense RSS growth MiB | varlen s | dense s | max abs diff |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for seq in args.seqs:
        rows = {}
        for path in ("varlen", "dense"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", path, str(seq)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows[path] = json.loads(done.stdout.strip().splitlines()[-1])
        diff = max(
            float(
                (
                    torch.load(
                        f"/tmp/document_attention_varlen_{seq}_cp{args.cp}_rank{r}.pt", weights_only=True
                    )
                    - torch.load(
                        f"/tmp/document_attention_dense_{seq}_cp{args.cp}_rank{r}.pt", weights_only=True
                    )
                )
                .abs()
                .max()
            )
            for r in range(args.cp)
        )
        var, den = rows["varlen"], rows["dense"]
        print(
            f"| {seq} | {' '.join(map(str, var['lengths']))} | {var['peak'] / MIB:,.1f} | {den['peak'] / MIB:,.1f} | "
            f"{var['peak'] / den['peak']:.3f} | {var['rss'] / MIB:,.1f} | {den['rss'] / MIB:,.1f} | "
            f"{var['s']:.2f} | {den['s']:.2f} | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
