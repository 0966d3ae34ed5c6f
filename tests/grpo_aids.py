"""Test aids for GRPO (tests/e2e/test_grpo.py, tests/unit/test_grpo.py).

`length`: a reward that varies on a random model's completions (their length in characters), so a
few-step run has advantages and gradients to compare across layouts.
`hot_sampler`: the sampler's per-token draw, but recording the plain log-probability from logits
divided by 0.7: a temperature applied only at sampling, the mismatch the trainer's check must catch.
`components(cfg)`: named in SUITE_TEST_COMPONENTS, it puts `hot_sampler` in the sampler's place.
"""

from __future__ import annotations

import torch

from suite.align import rollout
from suite.infer.generate import sample_with_logprobs


def length(prompt: str, completion: str, answer: str) -> float:
    return float(len(completion))


def hot_sampler(logits: torch.Tensor, cfg, generator: torch.Generator):
    token, sampled, _ = sample_with_logprobs(logits, cfg, generator)
    return token, sampled, (logits.float() / 0.7).log_softmax(-1).gather(-1, token)


def components(cfg) -> list:
    rollout.sample_with_logprobs = hot_sampler
    return []
