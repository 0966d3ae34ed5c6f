"""train.keep_host_memory: freed host memory stays in the process (glibc), measured as resident pages."""

import platform
import subprocess
import sys

import pytest
import torch

from suite.train.host_memory import apply_host_memory_setting

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocate and free a 256 MB tensor; print the resident MB it leaves behind once freed.
PROBE = """
import sys, torch
from suite.train.host_memory import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = resident_mb()
x = torch.ones(64 * 2**20)  # 256 MB, touched
del x
print(kept, round(resident_mb() - before))
"""


def freed_but_resident_mb(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    kept, mb = out.stdout.split()
    return kept, int(mb)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_freed_memory_stays_resident_only_when_kept():
    assert freed_but_resident_mb("default") == ("False", pytest.approx(0, abs=32))  # munmap'd at once
    assert freed_but_resident_mb("keep") == ("True", pytest.approx(256, abs=32))  # back in the heap, kept


def test_auto_keeps_host_memory_for_cpu_training_only(monkeypatch):
    calls = []
    monkeypatch.setattr("suite.train.host_memory.keep_freed_host_memory", lambda: calls.append(1) or True)
    assert apply_host_memory_setting("auto", torch.device("cpu")) is True
    assert apply_host_memory_setting("auto", torch.device("cuda")) is False
    assert apply_host_memory_setting(False, torch.device("cpu")) is False
    assert apply_host_memory_setting(True, torch.device("cuda")) is True
    assert len(calls) == 2
