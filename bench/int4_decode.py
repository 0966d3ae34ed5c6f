"""int4 decode against fp32 on a real checkpoint (issue 43), side by side in one process.

    python bench/int4_decode.py --gguf .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf

The model is read with `ckpt=gguf:` (dequantized to fp32); int4 is compress=int4's stored layout
(group 32, compress.skip's default: the tied embedding/head stays fp32), then packed for the CPU as
`suite generate` / `suite eval` load it (suite.models.int4_cpu); a third model adds
compress.embedding=int8 (the tied head in the int8 kernel). --stored also times the stored torchao
layout (dequantized in every matmul: the path before packing; slow, one call of 8 tokens). Each round
times every model in turn with the quantize report's own timer (suite.compress.before_after
.decode_speed: greedy, KV cache, best of 3 calls after a warm-up). One JSON line per round, then the
machine. The integers are round-to-nearest's; GPTQ's are stored in the same tensor type and run the
same kernels, so the speed is GPTQ's as well.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from gptq_real import cpu_name  # noqa: E402 (after the path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stored", action="store_true", help="also time the stored (unpacked) int4 layout")
    args = parser.parse_args()

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
    for r in range(args.rounds):
        row = {"round": r, **{n: round(decode_speed(m, prompt, args.tokens), 3) for n, m in models.items()}}
        row["load_1min"] = os.getloadavg()[0]
        print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "tokens": args.tokens}))


if __name__ == "__main__":
    main()
