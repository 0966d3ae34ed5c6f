"""The MFU denominator: tabled peaks for known GPUs, a measured matmul ceiling elsewhere."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path

import torch

from suite.runtime import DTYPES, emulates_low_precision

# Dense peak FLOP/s per device (no sparsity), from the vendors' data sheets: tensor-core figures for
# bf16/fp16/fp8, the plain (non-tensor-core) fp32 figure for fp32. Matched against
# torch.cuda.get_device_name() in this order (the first pattern that matches wins, so "H100 PCIe"
# before "H100", "L40S" before "L4"). A precision a device lacks (V100 bf16, A100 fp8) is absent.
T = 1e12
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 data sheet (SXM5 / PCIe / NVL)
    (r"H100.*PCIe", {"bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T, "fp32": 51 * T}),
    (r"H100.*NVL", {"bf16": 835 * T, "fp16": 835 * T, "fp8": 1671 * T, "fp32": 60 * T}),
    (r"H100", {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T, "fp32": 67 * T}),  # SXM ("H100 80GB HBM3")
    (r"H200", {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T, "fp32": 67 * T}),  # SXM
    (r"GH200", {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T, "fp32": 67 * T}),
    # NVIDIA A100 data sheet: 40 GB and 80 GB, SXM and PCIe share the compute figures
    (r"A100", {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T}),
    (r"A10G", {"bf16": 70 * T, "fp16": 70 * T, "fp32": 31.2 * T}),  # AWS g5 (the A10's cloud variant)
    (r"\bA10\b", {"bf16": 125 * T, "fp16": 125 * T, "fp32": 31.2 * T}),
    (r"L40S", {"bf16": 362 * T, "fp16": 362 * T, "fp8": 733 * T, "fp32": 91.6 * T}),
    (r"\bL40\b", {"bf16": 181 * T, "fp16": 181 * T, "fp8": 362 * T, "fp32": 90.5 * T}),
    (r"\bL4\b", {"bf16": 121 * T, "fp16": 121 * T, "fp8": 242 * T, "fp32": 30.3 * T}),
    (r"V100.*PCIE", {"fp16": 112 * T, "fp32": 14 * T}),  # no bf16 tensor cores
    (r"V100", {"fp16": 125 * T, "fp32": 15.7 * T}),  # SXM2
    (r"MI300X", {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T, "fp32": 163.4 * T}),  # AMD, ROCm
]


def tabled_peak(device_name: str, precision: str) -> float | None:
    """The data-sheet peak of a device (by its torch.cuda.get_device_name()) in `precision`, or None."""
    for pattern, peaks in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(precision)
    return None


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
    if precision == "fp8":  # against the bf16 peak, so an fp8 run's MFU compares with a bf16 run's
        precision = "bf16"
    if emulates_low_precision(device, precision):
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: MFU is not reported: this CPU only emulates {precision} matmuls, so no peak applies "
                "(train.peak_flops sets one in FLOP/s, e.g. train.peak_flops=5e11; fp32, or a CPU with native "
                "support, measures it)",
                file=sys.stderr,
            )
        return None
    if device.type == "cuda":  # the data sheet, or nothing: a guess would make every MFU wrong
        name = torch.cuda.get_device_name(device)
        peak = tabled_peak(name, precision)
        if peak is None and int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: MFU is not reported: no {precision} peak is tabled for {name} (suite/train/peak_flops.py "
                "GPU_PEAKS); train.peak_flops sets one in FLOP/s per device, e.g. train.peak_flops=9.89e14",
                file=sys.stderr,
            )
        return peak
    key = peak_key(device, precision)
    try:
        cached = json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError):
        cached = None
    if cached is None:
        return record_peak(key, measure_matmul_peak(device, precision))
    return float(cached)


class Ceiling:
    """The peak FLOP/s per device an MFU divides by (peak_flops). A CPU ceiling measured on a busy
    machine is too low, and the cache keeps it (contention only lowers a measurement, so the
    cache only ever raises an entry); a step that outruns it proves it wrong, so the ceiling is
    measured again then and raised to the highest of the cache, the new measurement and the
    step's own rate: an MFU above 1 is never reported."""

    def __init__(self, device: torch.device, precision: str, override: float | None = None):
        self.device, self.precision = device, "bf16" if precision == "fp8" else precision
        self.value = peak_flops(device, precision, override)
        self.measured = bool(self.value) and not override and device.type != "cuda"
        self.remeasured = False

    def mfu(self, tokens_per_s: float, flops_per_token: float, world_size: int) -> float | None:
        if not self.value:
            return None  # no peak applies (peak_flops)
        achieved = tokens_per_s * flops_per_token / world_size
        if achieved > self.value and self.measured:
            measured = 0.0
            if not self.remeasured:  # one new measurement a run; later, the step's rate itself
                self.remeasured = True
                measured = measure_matmul_peak(self.device, self.precision)
            self.value = record_peak(peak_key(self.device, self.precision), max(measured, achieved))
        return achieved / self.value


def cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """The CUDA caching allocator's peaks in GiB (empty off CUDA): what tensors held at most
    (`mem_allocated_gb`) and what the allocator kept from the driver (`mem_reserved_gb`; the gap is
    fragmentation and cached blocks, what an out-of-memory error counts against)."""
    if device.type != "cuda":
        return {}
    return {
        "mem_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on GPU, peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The memory columns of a metrics record: `mem_gb`, and on CUDA the allocator's peaks."""
    return {"mem_gb": memory_gb(device), **cuda_memory_stats(device)}
