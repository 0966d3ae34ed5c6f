"""int4 decode and prefill against fp32 on a real checkpoint (issue 43), side by side in one process.

    python bench/int4_decode.py --gguf .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf

The model is read with `ckpt=gguf:` (dequantized to fp32); int4 is compress=int4's stored layout
(group 32, compress.skip's default: the tied embedding/head stays fp32), then packed for the CPU as
`suite generate` / `suite eval` load it (suite.models.int4_cpu); a third model adds
compress.embedding=int8 (the tied head in the int8 kernel). --stored also times the stored torchao
layout (dequantized in every matmul: the path before packing; slow, one call of 8 tokens). Each round
times every model in turn with the quantize report's own timer (suite.compress.before_after
.decode_speed: greedy, KV cache, best of 3 calls after a warm-up), then a prefill: one forward of
--prefill-batch x --prefill-len tokens (the quantize report's perplexity batch: 8 x 256), best of 2
after a warm-up, for fp32, int4 packed and int4 packed with every call in the kernel (no dequantized
path for large inputs: int4_cpu.DEQUANT_ROWS set out of reach). One JSON line per round, then the
machine. The integers are round-to-nearest's; GPTQ's are stored in the same tensor type and run the
same kernels, so the speed is GPTQ's as well.

    python bench/int4_decode.py --crossover

times one int4 Linear alone, kernel against dequantize + F.linear, over input rows, for SmolLM2's
weight shapes (the measurement behind int4_cpu.DEQUANT_ROWS), and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from gptq_real import cpu_name  # noqa: E402 (after the path)

SHAPES = ((1536, 576), (576, 1536), (576, 576), (192, 576))  # SmolLM2-135M: w1/w3, w2, wq/wo, wk/wv


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


@contextlib.contextmanager
def kernel_only() -> Iterator[None]:
    """Every int4 call through the packed kernel (the layout before the dequantized large-input path)."""
    from suite.models import int4_cpu

    saved, int4_cpu.DEQUANT_ROWS = int4_cpu.DEQUANT_ROWS, 1 << 62
    try:
        yield
    finally:
        int4_cpu.DEQUANT_ROWS = saved


def _crossover_row(packed: torch.nn.Module, dense: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """ms of one call: the packed kernel (bf16 in), dequantize + F.linear, fp32 F.linear."""
    flat = x.bfloat16()
    sz = packed.scales_and_zeros
    return {
        "kernel_ms": best_ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed.packed, packed.group, sz).float(),
            5,
        ),
        "dequant_linear_ms": best_ms(lambda: F.linear(x, packed.dequantized(torch.float32)), 5),
        "fp32_linear_ms": best_ms(lambda: F.linear(x, dense), 5),
    }


@torch.no_grad()
def crossover(rows: list[int]) -> None:
    """Per weight shape and input rows: ms of the packed kernel and of dequantize + fp32 F.linear."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_

    from suite.models.int4_cpu import PackedInt4Linear

    for n, k in SHAPES:
        torch.manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False)
        dense = linear.weight.detach().clone()
        quantize_(linear, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
        packed = PackedInt4Linear(linear.weight, None)
        for m in rows:
            row = {"weight": f"{n}x{k}", "rows": m, **_crossover_row(packed, dense, torch.randn(m, k))}
            print(
                json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--stored", action="store_true", help="also time the stored (unpacked) int4 layout")
    parser.add_argument("--crossover", action="store_true", help="time single int4 Linear layers and exit")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 2048])
    args = parser.parse_args()
    if args.crossover:
        crossover(args.rows)
        print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads()}))
        return
    if not args.gguf:
        parser.error("--gguf is required (unless --crossover)")

    from suite.compress.before_after import decode_speed
    from suite.compress.methods import quantize_model
    from suite.config.schema import CompressConfig
    from suite.model_source import ModelSource
    from suite.models.int4_cpu import pack_for_cpu

    source = ModelSource.parse(f"gguf:{args.gguf}")
    tokenizer, fp32 = source.tokenizer(), source.load_model().eval().requires_grad_(False)
    prompt = tokenizer.encode("The licence grants every recipient the right to copy and change the program")[
        :16
    ]
    models = {"fp32": fp32}
    for name, embedding in (("int4_packed", "none"), ("int4_packed_int8_head", "int8")):
        model = copy.deepcopy(fp32)
        quantize_model(model, CompressConfig(method="int4", embedding=embedding), torch.device("cpu"))
        if args.stored and embedding == "none":
            stored = decode_speed(model, prompt, 8, repeats=1)
            print(json.dumps({"int4_stored_layout_8_tokens_1_call": stored}), flush=True)
        pack_for_cpu(model)
        models[name] = model
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, fp32.cfg.vocab_size, (args.prefill_batch, args.prefill_len), generator=gen)
    with torch.no_grad():
        fp32_logits, int4_logits = fp32(batch), models["int4_packed"](batch)
        with kernel_only():
            kernel_logits = models["int4_packed"](batch)
    print(
        json.dumps(
            {
                "prefill_max_abs_diff_dequantized_vs_kernel": float(
                    (int4_logits - kernel_logits).abs().max()
                ),
                "prefill_max_abs_diff_int4_vs_fp32": float((int4_logits - fp32_logits).abs().max()),
            }
        ),
        flush=True,
    )
    del fp32_logits, int4_logits, kernel_logits
    for r in range(args.rounds):
        row = {"round": r, **{n: round(decode_speed(m, prompt, args.tokens), 3) for n, m in models.items()}}
        with torch.no_grad():
            row["prefill_ms_fp32"] = round(best_ms(lambda: fp32(batch), 2), 1)
            row["prefill_ms_int4_packed"] = round(best_ms(lambda: models["int4_packed"](batch), 2), 1)
            with kernel_only():
                row["prefill_ms_int4_kernel_only"] = round(
                    best_ms(lambda: models["int4_packed"](batch), 2), 1
                )
        row["load_1min"] = os.getloadavg()[0]
        print(json.dumps(row), flush=True)
    shape = f"{args.prefill_batch}x{args.prefill_len}"
    print(
        json.dumps(
            {"cpu": cpu_name(), "threads": torch.get_num_threads(), "tokens": args.tokens, "prefill": shape}
        )
    )


if __name__ == "__main__":
    main()
