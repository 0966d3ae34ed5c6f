"""The MFU denominator: tabled peaks for known GPUs, a measured matmul ceiling elsewhere."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from suite.runtime import DTYPES, emulates_low_precision

# Dense peak FLOP/s per device (no sparsity), from the vendors' data sheets.
GPU_PEAKS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
}


PROBE_SIZE = 256  # the first, cheap product that tells which sizes fit the time budget


def measure_matmul_peak(
    device: torch.device, precision: str, sizes: tuple[int, ...] = (1024, 2048), seconds: float = 0.5
) -> float:
    """Best sustained FLOP/s of square matmuls: the ceiling a training step can approach.

    The best over a few sizes and repetitions, because a busy machine only ever makes a
    measurement lower, never higher. A small probe first: sizes whose one product would outlast
    twice `seconds` are skipped, so a precision the CPU only emulates (bf16 without
    AVX-512 BF16, ~1 GFLOP/s) costs a second here, not minutes.
    """
    dtype = DTYPES[precision]

    def product_flops_per_s(a: torch.Tensor, b: torch.Tensor, repeat: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        return repeat * 2 * a.shape[0] ** 3 / (time.perf_counter() - start)

    probe = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device).to(dtype)
    probe @ probe
    best = product_flops_per_s(probe, probe, 1)
    for size in sizes:
        if 2 * size**3 / best > 2 * seconds:
            continue
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        for _ in range(2):
            a @ b
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            best = max(best, product_flops_per_s(a, b, 2))
    return best


def record_peak(key: str, measured: float) -> float:
    """Keep the highest ceiling ever measured for `key` (contention only lowers a measurement)."""
    cache = _cache_file()
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = max(float(table.get(key, 0.0)), measured)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return table[key]


def peak_key(device: torch.device, precision: str) -> str:
    return f"{platform.processor() or platform.machine()}|{device.type}|{torch.get_num_threads()}|{precision}"


def _cache_file() -> Path:
    return Path(os.environ.get("SUITE_CACHE", Path.home() / ".cache" / "suite")) / "peak_flops.json"


def peak_flops(device: torch.device, precision: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the recipe's value, the data sheet, or a cached measurement.

    None where no peak applies: a CPU that only emulates `precision` (fp16/bf16 without native
    instructions) runs a step's matmuls through other paths than the square products one can time,
    so an MFU against the emulated ceiling came out above 1; it is not reported (said once)."""
    if override:
        return float(override)
    if emulates_low_precision(device, precision):
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: MFU is not reported: this CPU only emulates {precision} matmuls, so no peak applies "
                "(train.peak_flops=<FLOP/s> sets one; fp32, or a CPU with native support, measures it)",
                file=sys.stderr,
            )
        return None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks[precision]
    key = peak_key(device, precision)
    try:
        cached = json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError):
        cached = None
    if cached is None:
        return record_peak(key, measure_matmul_peak(device, precision))
    return float(cached)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on GPU, peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
