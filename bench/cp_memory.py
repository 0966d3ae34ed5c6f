"""Per-rank activation memory of one training step under context parallelism (cp = 1, 2, 4).

    python bench/cp_memory.py [--cp 1 2 4 --seq 4096 --layers 4 --hidden 256 --heads 8 --kv-heads 8
                               --vocab 8192 --family gpt --batch 1] [--out docs/benchmarks.md]

For each cp degree it starts cp CPU processes (gloo), builds the same seeded model on each, swaps
in the context-parallel attention (`suite.parallel.context_parallel`, as `parallelize` does), gives
every rank its two load-balanced chunks of the same batch (`split_batch`) and runs one forward +
backward with the trainer's loss. Per rank, as in bench/recompute_memory.py:

- saved for backward: bytes of the distinct tensor storages autograd keeps after the forward
  (a saved-tensor hook; parameters excluded): the activations of the step.
- peak step memory: the highest live tensor memory during forward + backward (torch's MemTracker),
  minus parameters and gradients; it includes the logits and the transient gathered K/V.

The table shows the largest rank of each cp degree, its ratio to cp=1 and the loss (the mean over
every token of the batch, all-reduced over the cp ranks: the same for every cp). With --out the
section "Context parallelism: activation memory per rank" of that markdown file is replaced (or
appended).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from suite.config.schema import ModelConfig  # noqa: E402
from suite.models import build_model, materialize  # noqa: E402
from suite.train.trainer import cross_entropy  # noqa: E402

MIB = 2**20
SECTION = "## Context parallelism: activation memory per rank"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inputs(cfg: ModelConfig, batch: torch.Tensor, cp: int, rank: int):
    from suite.data.batch import Batch

    micro = Batch.from_windows(batch)
    if cp == 1:
        return micro.tokens, micro.labels, {}
    from suite.parallel.context_parallel import split_batch

    return split_batch(micro, cp, rank)


def _saved_bytes(model, tokens, targets, kwargs) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model(tokens, **kwargs), targets)
    del loss
    return sum(n for ptr, n in storages.items() if ptr not in params)


def _peak_bytes(model, tokens, targets, kwargs) -> tuple[int, float]:
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, tokens)
    with tracker:
        loss = cross_entropy(model(tokens, **kwargs), targets)
        loss.backward()
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda d: d.get("Total", 0))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return peak["Total"] - 2 * weights, float(loss.detach())


def _worker(rank: int, cp: int, port: int, cfg: ModelConfig, batch: torch.Tensor, queue) -> None:
    torch.set_num_threads(1)
    model = materialize(build_model(cfg), "cpu", seed=0)
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from suite.parallel.context_parallel import apply_context_parallel

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
        apply_context_parallel(model, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    tokens, targets, kwargs = _inputs(cfg, batch, cp, rank)
    saved = _saved_bytes(model, tokens, targets, kwargs)
    peak, loss = _peak_bytes(model, tokens, targets, kwargs)
    if cp > 1:
        total = torch.tensor([loss])
        dist.all_reduce(total)
        loss = float(total) / cp
        dist.destroy_process_group()
    queue.put((cp, rank, saved, peak, loss))


def measure(cfg: ModelConfig, batch: torch.Tensor, degrees: list[int]) -> dict[int, tuple[int, int, float]]:
    """cp -> (max saved bytes over ranks, max peak bytes over ranks, global mean loss)."""
    ctx = mp.get_context("spawn")
    results: dict[int, tuple[int, int, float]] = {}
    for cp in degrees:
        queue = ctx.Queue()
        mp.start_processes(
            _worker, args=(cp, _free_port(), cfg, batch, queue), nprocs=cp, start_method="spawn"
        )
        rows = [queue.get() for _ in range(cp)]
        results[cp] = (max(r[2] for r in rows), max(r[3] for r in rows), rows[0][4])
        print(
            f"cp={cp}: saved {results[cp][0] / MIB:,.1f} MiB, peak {results[cp][1] / MIB:,.1f} MiB",
            flush=True,
        )
    return results


def table(results: dict[int, tuple[int, int, float]]) -> str:
    saved1, peak1, _ = results[min(results)]
    rows = [
        f"| {cp} | {saved / MIB:,.1f} | {saved / saved1:.2f} | {peak / MIB:,.1f} | {peak / peak1:.2f} | {loss:.6f} |"
        for cp, (saved, peak, loss) in sorted(results.items())
    ]
    return "\n".join(
        [
            "| cp | saved for backward per rank (MiB) | vs cp=1 | peak step memory per rank (MiB) | vs cp=1 | loss |",
            "|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of `path` (up to the next `## ` heading), or append it."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(SECTION)
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    end = old.find("\n## ", start + len(SECTION))
    rest = old[end + 1 :] if end >= 0 else ""
    path.write_text(old[:start] + text + ("\n" + rest if rest else ""))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--family", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if 1 not in args.cp:
        ap.error("--cp must include 1 (the reference)")
    for cp in args.cp:
        if args.seq % (2 * cp):
            ap.error(f"--seq {args.seq} is not divisible by 2*cp={2 * cp}")
    cfg = ModelConfig(
        family=args.family,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    results = measure(cfg, batch, sorted(args.cp))
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    command = "python bench/cp_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"{SECTION}\n\n"
        f"Measured with `{command.strip()}` (method in its docstring): one forward + backward of "
        f"{args.family.upper() if args.family == 'gpt' else 'Llama'}, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads ({args.kv_heads or args.heads} KV), vocab {args.vocab} ({n_params / 1e6:.1f}M parameters), "
        f"batch {args.batch} x seq {args.seq}, fp32, on CPU processes over gloo "
        f"({platform.processor() or platform.machine()}, torch {torch.__version__}). Each cp rank holds seq/cp "
        "tokens (two load-balanced chunks); the figures are the largest rank's. *saved for backward* is what "
        "autograd keeps after the forward; *peak step memory* is the highest live tensor memory during forward + "
        "backward minus parameters and gradients (logits and the transient all-gathered K/V included).\n\n"
        f"{table(results)}\n"
    )
    if 2 in results:
        saved_ratio, peak_ratio = (results[2][i] / results[1][i] for i in (0, 1))
        text += (
            f"\ncp=2 keeps {saved_ratio:.2f} of cp=1's saved activations and reaches {peak_ratio:.2f} of its peak per "
            "rank: every saved activation (Q/K/V included: the all-gather keeps only the local chunks for "
            "backward and gathers again there) is split by cp; what does not split, one layer's gathered K/V "
            "while its attention runs, is small next to the rest at this size.\n"
        )
    print("\n" + text)
    if args.out:
        write_section(args.out, text)
    return text


if __name__ == "__main__":
    main()
