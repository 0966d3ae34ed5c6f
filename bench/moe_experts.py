"""Forward + backward of one Mixtral-shaped MoE layer with each `model.moe_impl`, side by side.

One `MoEFeedForward` (SwiGLU experts, top-k softmax router, dropless; Mixtral 8x7B's 8 experts, top-2,
expert width 3.5 x hidden) on `--tokens` tokens, the same weights and input for every impl; the impls
take turns within each repetition so a load change on a shared machine hits them alike. Reported:
median wall and CPU seconds of `--reps` timed repetitions after one warm-up, and the largest output
difference from the loop.
    python bench/moe_experts.py --hidden 1024 --ffn 3584 --experts 8 --top-k 2 --tokens 512
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from suite.config.schema import ModelConfig
from suite.models.moe import MOE_IMPLS, MoEFeedForward, grouped_mm_fits


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build(args: argparse.Namespace, dtype: torch.dtype) -> tuple[MoEFeedForward, torch.Tensor]:
    cfg = ModelConfig(
        family="llama",
        hidden_size=args.hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        moe_ffn_hidden_size=args.ffn,
    )
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, args.tokens, args.hidden, dtype=dtype)
    return layer.train(), x


def step(layer: MoEFeedForward, x: torch.Tensor, impl: str, grad: torch.Tensor) -> torch.Tensor:
    layer.experts.impl = impl
    x = x.detach().requires_grad_()
    out = layer(x)
    out.backward(grad)
    layer.zero_grad(set_to_none=True)
    return out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(MOE_IMPLS), choices=MOE_IMPLS)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    layer, x = build(args, dtype)
    grad = torch.randn_like(x)
    ex = layer.experts
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.precision}; "
        f"{args.experts} experts top-{args.top_k}, hidden {args.hidden}, expert ffn {args.ffn}, "
        f"{args.tokens} tokens; torch._grouped_mm runs here: {grouped_mm_fits(x[0], ex.w1, ex.w2)}; "
        f"median of {args.reps}"
    )
    reference = step(layer, x, "loop", grad)
    outputs = {impl: step(layer, x, impl, grad) for impl in args.impls}  # warm-up
    wall: dict[str, list[float]] = {impl: [] for impl in args.impls}
    cpu: dict[str, list[float]] = {impl: [] for impl in args.impls}
    for _ in range(args.reps):
        for impl in args.impls:
            start, cpu_start = time.perf_counter(), time.process_time()
            step(layer, x, impl, grad)
            wall[impl].append(time.perf_counter() - start)
            cpu[impl].append(time.process_time() - cpu_start)
    loop_ms = statistics.median(wall["loop"]) * 1e3 if "loop" in wall else None
    print(
        "| model.moe_impl | fwd+bwd ms | CPU ms | vs loop | max abs diff from loop |\n|---|---:|---:|---:|---:|"
    )
    for impl in args.impls:
        ms = statistics.median(wall[impl]) * 1e3
        ratio = f"{loop_ms / ms:.2f}x" if loop_ms else "-"
        diff = float((outputs[impl].float() - reference.float()).abs().max())
        print(f"| {impl} | {ms:.1f} | {statistics.median(cpu[impl]) * 1e3:.1f} | {ratio} | {diff:.1e} |")


if __name__ == "__main__":
    main()
