"""GRPO's sampler: G completions of one prompt, batched, with every sampled token's log-probabilities.

For each sampled token the sampler records two numbers: its log-probability under the distribution it
was drawn from (temperature and top-p applied: `sample_logprobs`) and its plain log-probability
log_softmax(logits) (`logprobs`), which the trainer recomputes from its own forward of the same tokens
and compares before updating (suite.align.grpo).

Why the sampler can agree with the trainer exactly. A matmul's result depends on its shapes (the
kernel and its blocking are chosen by them): a KV-cache decode step multiplies [G, 1] rows, the
trainer's forward [G, prompt + completion] rows, and the log-probabilities differ by up to ~1e-5 in
fp32 on a CPU (measured: gpt-tiny's shape with random weights x3). The `exact` sampler (the default) therefore decodes each token
with the forward the trainer runs: the whole [G, prompt + max_new_tokens] rows, positions after
the current one filled with padding. Causal attention keeps those from the current position, and a
kernel on the same shapes computes a row the same way whatever the other rows hold, so the trainer's
log-probabilities equal the sampler's bit for bit. It costs a full forward per token (the prompts of
built-in tasks are short); `kv` decodes with the KV cache (suite.models.KVCache) instead: faster,
agreeing to ~1e-5 in fp32.

Randomness: the generator is seeded from (seed, the prompt's number in the run's prompt order), so the
completions of a prompt are the same in any data-parallel layout (the ranks sample different prompts)
and after a resume, which only needs the number of rollout batches done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.schema import GenerateConfig
from suite.data.batch import IGNORE_INDEX, Batch
from suite.infer.generate import sample_with_logprobs
from suite.models import KVCache


@dataclass
class Group:
    """G completions of one prompt, in the trainer's shapes: tokens and labels [G, prompt + max_new]
    (labels[t] = tokens[t + 1] at the completion's positions, eos included, IGNORE_INDEX elsewhere); logprobs and
    sample_logprobs [G, same], zero where labels are ignored."""

    prompt_number: int
    prompt_len: int
    tokens: torch.Tensor
    labels: torch.Tensor
    logprobs: torch.Tensor  # plain log_softmax of the sampled tokens (what the trainer recomputes)
    sample_logprobs: torch.Tensor  # under the temperature / top-p distribution they were drawn from
    completions: list[list[int]]  # each row's completion ids, eos removed
    rewards: torch.Tensor | None = None  # [G], set by the rewards
    advantages: torch.Tensor | None = None  # [G], normalised within the group

    def batch(self) -> Batch:
        return Batch(self.tokens, self.labels)

    @property
    def mask(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX


def head_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits [b, s, vocab] as the trainer's step computes them: the forward's `head` hook hands the
    final hidden states and the head weight, projected here with one F.linear (suite.align.grpo's
    loss projects the same way)."""
    return model(tokens, head=lambda hidden, weight: F.linear(hidden, weight))


def rollout_generator(seed: int, prompt_number: int, device: torch.device) -> torch.Generator:
    """The generator of one prompt's completions: a function of (seed, prompt number) only."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + prompt_number)


@torch.no_grad()
def sample_group(
    model: nn.Module,
    prompt: list[int],
    group_size: int,
    max_new_tokens: int,
    sampling: GenerateConfig,
    generator: torch.Generator,
    eos_id: int | None,
    pad_id: int,
    *,
    prompt_number: int = 0,
    kv: bool = False,
) -> Group:
    """`group_size` completions of `prompt` (token ids), at most `max_new_tokens` each, ending at eos.

    Every row decodes `max_new_tokens` steps (rows that met eos keep sampling into ignored positions),
    so every rank runs the same forwards: a sharded model's collectives stay paired across ranks.
    """
    device = next(model.parameters()).device
    p, n = len(prompt), max_new_tokens
    length = p + n  # the trainer's input: prompt + completion (the last position predicts nothing)
    tokens = torch.full((group_size, length), pad_id, dtype=torch.long, device=device)
    tokens[:, :p] = torch.tensor(prompt, device=device)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    logprobs = torch.zeros(group_size, length, device=device)
    sample_logprobs = torch.zeros_like(logprobs)
    done = torch.zeros(group_size, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        cache = KVCache.empty(model, batch=group_size, max_len=length) if kv else None
        if kv:
            logits = model(tokens[:, :p], kv_cache=cache)[:, -1]
        for step in range(n):
            at = p - 1 + step  # the position whose logits give completion token `step`
            if not kv:
                logits = head_logits(model, tokens)[:, at]
            token, sampled_lp, plain_lp = sample_with_logprobs(logits, sampling, generator)
            token = token[:, 0]
            live = ~done
            labels[live, at] = token[live]
            logprobs[live, at] = plain_lp[live, 0]
            sample_logprobs[live, at] = sampled_lp[live, 0]
            if eos_id is not None:
                done |= token == eos_id
            tokens[:, at + 1] = torch.where(live, token, torch.full_like(token, pad_id))
            if kv and step + 1 < n:
                logits = model(tokens[:, at + 1 : at + 2], kv_cache=cache)[:, -1]
    finally:
        model.train(was_training)
    completions = []
    for row in range(group_size):
        ids = labels[row][labels[row] != IGNORE_INDEX].tolist()
        completions.append(ids[:-1] if ids and eos_id is not None and ids[-1] == eos_id else ids)
    return Group(prompt_number, p, tokens, labels, logprobs, sample_logprobs, completions)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at each label [b, s] (fp32), 0 where the label is ignored."""
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    picked = logits.float().log_softmax(-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return picked * mask
