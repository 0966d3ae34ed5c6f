"""What bounds a batch-1 decode step on this CPU: the memory read bandwidth and torch's one-row matmul
over SmolLM2-135M's block weights (random values, its shapes) per precision and weight layout.

    python bench/decode_kernels.py

Prints read/copy bandwidth (best of 5 over a 512 MiB fp32 tensor) and, per dtype (fp32, bf16, fp16)
and layout ("t": the weight stored as its [in, out] transpose, what the fp32 decode layout holds;
"stored": [out, in], nn.Linear's own), the time of one row through all 30 layers' fused projections
(q/k/v 576->960, o 576->576, gate/up 576->3072, down 1536->576), best of 5, and the GB/s it streams.
"""

from __future__ import annotations

import time

import torch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out) per projection, 30 layers


def best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _step(weights: list[torch.Tensor], rows: dict[int, torch.Tensor], transposed: bool):
    """One row through every projection, as the decoder multiplies it."""

    def step() -> None:
        for (i, _), w in zip(SHAPES, weights):
            if transposed:
                rows[i] @ w
            else:
                torch.nn.functional.linear(rows[i], w)

    return step


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    data = torch.ones(128 * 2**20)
    print(f"read (sum) {data.numel() * 4 / best(data.sum) / 1e9:.1f} GB/s")
    out = torch.empty_like(data)
    print(f"copy (read + write) {2 * data.numel() * 4 / best(lambda: out.copy_(data)) / 1e9:.1f} GB/s")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout in ("t", "stored"):
            weights = []
            for i, o in SHAPES:
                w = torch.randn(o, i).to(dtype)
                weights.append(w.t().contiguous() if layout == "t" else w)
            rows = {i: torch.randn(1, i).to(dtype) for i, _ in SHAPES}

            step = _step(weights, rows, layout == "t")
            step()
            seconds = best(step)
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            print(
                f"{dtype} {layout}: {seconds * 1e3:.2f} ms for {nbytes / 1e6:.0f} MB -> {nbytes / seconds / 1e9:.1f} GB/s"
            )


if __name__ == "__main__":
    main()
