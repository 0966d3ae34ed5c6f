"""Test aids for GRPO (tests/e2e/test_grpo.py).

`length`: a reward that varies on a random model's completions (their length in characters), so a
few-step run has advantages and gradients to compare across layouts.
`components(cfg)`: named in SUITE_TEST_COMPONENTS, it makes the sampler record its log-probabilities
from logits divided by 0.7, a temperature the trainer does not apply (the mismatch the check catches).
"""

from __future__ import annotations

from suite.align import rollout


def length(prompt: str, completion: str, answer: str) -> float:
    return float(len(completion))


def components(cfg) -> list:
    rollout.RECORD_LOGIT_SCALE = 1 / 0.7
    return []
