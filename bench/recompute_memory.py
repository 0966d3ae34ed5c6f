"""Peak activation memory and step time of each recompute option, for one model on this machine.

    python bench/recompute_memory.py [--layers 6 --hidden 512 --seq 512 --batch 4 --steps 3]
                                     [--out docs/benchmarks_recompute.md]

For every option (none, full, full_attn, core_attn, and full with half the layers) it measures,
on a GPT block stack (fp32, CPU unless --device cuda):

- saved for backward: bytes of the distinct tensor storages autograd keeps after the forward
  (a saved-tensor hook; parameters excluded). This is the activation memory recompute trades away.
- peak memory: the highest total of live tensor memory over a forward + backward step, from
  torch's MemTracker (a dispatch-mode tracker that works on CPU), with the part held by parameters
  and gradients subtracted, so what is left is activations plus the temporaries of the step,
  including what recompute re-creates during backward.
- step time: median wall time and CPU time (all threads of this process: what the step costs
  whatever else a shared machine runs) of forward + backward, no tracker attached, over --steps
  rounds in which the options take turns, after a warm-up step each.

Both with torch's default attention kernel (on CPU a flash kernel, which never keeps the s x s
attention probabilities) and forced through the math kernel (which keeps them, as GPUs without
flash attention do): core_attn's saving is the s x s probabilities, so it only shows in the latter.

Prints a markdown table and, with --out, writes it with the machine and model description.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from suite.config.schema import ModelConfig, RecomputeConfig  # noqa: E402
from suite.models import build_model, materialize  # noqa: E402
from suite.parallel.recompute import apply_recompute  # noqa: E402

MIB = 2**20


def options(layers: int) -> list[tuple[str, RecomputeConfig]]:
    return [
        ("none", RecomputeConfig("none")),
        ("core_attn", RecomputeConfig("core_attn")),
        ("full_attn", RecomputeConfig("full_attn")),
        ("full", RecomputeConfig("full")),
        (f"full, num_layers={layers // 2}", RecomputeConfig("full", num_layers=layers // 2)),
    ]


def make_model(cfg: ModelConfig, recompute: RecomputeConfig, device: str):
    model = build_model(cfg)
    apply_recompute(model, recompute)
    return materialize(model, device, seed=0)


def step(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def saved_bytes(model, tokens) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    del loss, logits
    return sum(n for ptr, n in storages.items() if ptr not in params)


def peak_step_bytes(model, tokens) -> int:
    """Peak live tensor bytes during forward+backward, minus parameters and gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, tokens)
    with tracker:
        step(model, tokens)
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda d: d.get("Total", 0))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return peak["Total"] - 2 * weights  # parameters + their gradients (both live at the peak, or less)


def step_seconds(models: list, tokens: torch.Tensor, steps: int) -> list[tuple[float, float, float]]:
    """(median wall seconds, median CPU seconds of this process, loss) of forward+backward per model.

    The models take turns, one step each per round, so a load change on a shared machine hits
    every option alike; CPU time (all threads of this process) is what the step costs whatever
    else the machine runs."""
    losses = []
    for model in models:  # warm-up
        model.zero_grad(set_to_none=True)
        losses.append(float(step(model, tokens)))
    wall: list[list[float]] = [[] for _ in models]
    cpu: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        for i, model in enumerate(models):
            model.zero_grad(set_to_none=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            step(model, tokens)
            wall[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - start_cpu)
    return [(statistics.median(w), statistics.median(c), loss) for w, c, loss in zip(wall, cpu, losses)]


def measure(cfg: ModelConfig, tokens: torch.Tensor, steps: int, device: str) -> list[str]:
    names, models, memory = [], [], []
    for name, recompute in options(cfg.num_layers):
        model = make_model(cfg, recompute, device)
        memory.append((saved_bytes(model, tokens), peak_step_bytes(model, tokens)))
        names.append(name)
        models.append(model)
    timing = step_seconds(models, tokens, steps)
    (saved0, peak0), (wall0, cpu0, _) = memory[0], timing[0]
    rows = [
        f"| {name} | {saved / MIB:,.1f} | {saved / saved0:.2f} | {peak / MIB:,.1f} | {peak / peak0:.2f} "
        f"| {wall:.2f} | {wall / wall0:.2f} | {cpu:.2f} | {cpu / cpu0:.2f} | {loss:.6f} |"
        for name, (saved, peak), (wall, cpu, loss) in zip(names, memory, timing)
    ]
    return [
        "| recompute | saved for backward (MiB) | vs none | peak step memory (MiB) | vs none "
        "| step wall time (s) | vs none | step CPU time (s) | vs none | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


ATTENTION = {
    "flash": "attention through torch's default kernel (on CPU a flash kernel: softmax(QK^T) is never kept)",
    "math": "attention forced through the math kernel (softmax(QK^T) is materialised and kept for "
    "backward, as on GPUs without flash attention or with custom masks)",
}


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", choices=[*ATTENTION, "both"], default="both")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(args.device)
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    header = (
        f"GPT, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
        f"({n_params / 1e6:.1f}M parameters), batch {args.batch} x seq {args.seq}, fp32, one forward+backward "
        f"on {args.device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}); step times are medians of {args.steps} interleaved rounds; "
        f"load average when the run ended: {os.getloadavg()[0]:.1f}."
    )
    parts = [header]
    for kind in ATTENTION if args.attention == "both" else [args.attention]:
        backend = SDPBackend.MATH if kind == "math" else None
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            table = measure(cfg, tokens, args.steps, args.device)
        parts += [f"**{kind}**: {ATTENTION[kind]}.", "\n".join(table)]
        print("\n\n".join(parts[-2:]) + "\n", flush=True)
    text = "\n\n".join(parts) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# Activation recompute: memory and time\n\n"
            "Measured with `python bench/recompute_memory.py` (method in its docstring). *saved for "
            "backward* is what autograd keeps after the forward (the activations recompute trades away); "
            "*peak step memory* is the highest live tensor memory during forward + backward minus parameters "
            "and gradients (it includes the logits and what recompute re-creates during backward).\n\n" + text
        )
    return text


if __name__ == "__main__":
    main()
