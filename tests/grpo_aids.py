"""Test aids for GRPO (tests/e2e/test_grpo.py, tests/unit/test_grpo.py).

`length`: a reward that varies on a random model's completions (their length in characters), so a
few-step run has advantages and gradients to compare across layouts. With SUITE_TEST_GRPO_PAUSE=
"TRIGGER|MARKER" set (tests/e2e/test_grpo.py's killed pipeline) it holds the run once the file TRIGGER
exists (a checkpoint's manifest): it creates MARKER and sleeps, so a test SIGKILLs it at a known point.
`hot_sampler`: the sampler's per-token draw, but recording the plain log-probability from logits
divided by 0.7: a temperature applied only at sampling, the mismatch the trainer's check must catch.
`components(cfg)`: named in SUITE_TEST_COMPONENTS, it puts `hot_sampler` in the sampler's place.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from suite.align import rollout
from suite.infer.generate import sample_with_logprobs

PAUSE_ENV = "SUITE_TEST_GRPO_PAUSE"


def length(prompt: str, completion: str, answer: str) -> float:
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        trigger, marker = pause.split("|")
        if Path(trigger).exists():
            Path(marker).touch()
            time.sleep(600)  # until the test kills the run
    return float(len(completion))


def hot_sampler(logits: torch.Tensor, cfg, generator: torch.Generator):
    token, sampled, _ = sample_with_logprobs(logits, cfg, generator)
    return token, sampled, (logits.float() / 0.7).log_softmax(-1).gather(-1, token)


def components(cfg) -> list:
    rollout.sample_with_logprobs = hot_sampler
    return []
