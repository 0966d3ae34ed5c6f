"""`train.keep_host_memory`: keep freed host memory in the process instead of handing it back every step.

A training step on the CPU allocates and frees the same large tensors every step (activations, logits
chunks, gradients). glibc's malloc serves each allocation above its mmap threshold with a fresh `mmap` and
returns it with `munmap` when freed, and trims the top of its heap back to the kernel as soon as a few
hundred KB are free; either way the next step touches new pages and the kernel zero-fills them again, one
page fault per 4 KB. On this 2-core machine that was 13% of a GPT 12x768 step and a third of a gpt-tiny
step (docs/performance.md). Disabling mmap for allocations and raising the trim threshold keeps the
pages: a step reuses the previous step's memory, and the process's resident size stays at its peak
(which it reaches anyway) instead of rising and falling every step.

Only glibc has `mallopt`; elsewhere (macOS, musl) this reports False and changes nothing. GPU training
allocates device memory through the CUDA caching allocator, which already keeps it, so `auto` turns this
on for CPU training only.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

M_TRIM_THRESHOLD = -1  # <malloc.h>: free heap top above this many bytes is returned to the kernel
M_MMAP_MAX = -4  # <malloc.h>: the most allocations served by mmap at once; 0 serves all from the heap
NEVER_TRIM = 2**31 - 1  # the largest value mallopt's int parameter takes


def keep_freed_host_memory() -> bool:
    """Tell glibc malloc to serve every allocation from its heaps and never trim them; True if it did."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def apply_host_memory_setting(setting: bool | str, device: torch.device) -> bool:
    """Apply `train.keep_host_memory` (auto: on for CPU training); True when freed memory is now kept."""
    wanted = device.type == "cpu" if setting == "auto" else bool(setting)
    return keep_freed_host_memory() if wanted else False
