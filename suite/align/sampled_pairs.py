"""Preference pairs from the starting policy's own mistakes (align.data=task:<name>, align.pair_samples=N).

Swapping two digits of the right answer (suite.align.pairs.corrupt) makes a rejected answer the SFT model
mostly ranks below the right one already, so DPO learns little from it. Here the rejected answer is one
the model itself gives: for each training question, N answers are sampled from model.init_from (the
weights DPO starts from and its reference) with GRPO's sampler (suite.align.rollout: batched, KV cache,
align.pair_temperature, a generator seeded by (train.seed, question number)), and the most frequent
wrong one (the first drawn among equals) is paired, as `rejected`, with the task's answer as `chosen`.
A question none of whose samples is wrong falls back to the corrupted answer; their count is logged.
Every data-parallel rank samples the same answers (same weights, same generators), so the pairs agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from suite.align.pairs import corrupt
from suite.align.rollout import rollout_generator, sample_group
from suite.config.schema import GenerateConfig
from suite.data.chat import prompt_ids
from suite.data.tasks import generate_task, get_task, score

# (question number, the prompt's chat messages) -> the answers sampled for it
Sampler = Callable[[int, list[dict]], list[str]]


def pick_rejected(samples: list[str], answer: str, task: str) -> str | None:
    """The most frequent wrong, non-empty sample (the first drawn among equals); None when none is wrong."""
    wrong = [s for s in samples if s.strip() and not score(task, s, answer)]
    if not wrong:
        return None
    counts = Counter(wrong)
    return max(wrong, key=lambda s: counts[s])  # max keeps the first of equal counts


def sampled_task_pairs(
    name: str, num: int, seed: int, held_out: int, sample: Sampler
) -> tuple[list[dict[str, str]], int]:
    """(`num` pairs {prompt, chosen, rejected} of a built-in task's training questions, how many fell
    back to a corrupted answer): the rejected answer is `pick_rejected` of the question's samples."""
    rows, _ = generate_task(name, num, held_out, seed)
    pairs, fallbacks = [], 0
    for number, messages in enumerate(rows):
        answer = messages[-1]["content"]
        rejected = pick_rejected(sample(number, messages[:-1]), answer, name)
        if rejected is None:
            rejected, fallbacks = corrupt(answer), fallbacks + 1
        pairs.append({"prompt": messages[-2]["content"], "chosen": answer, "rejected": rejected})
    return pairs, fallbacks


def policy_sampler(
    model: nn.Module,
    tokenizer,
    template: str,
    task: str,
    num_samples: int,
    temperature: float,
    seed: int,
) -> Sampler:
    """A `Sampler` drawing `num_samples` answers per question from `model` (the task's answer budget:
    its longest answer + 2 tokens), decoded as GRPO's rewards read them."""
    device = next(model.parameters()).device
    sampling = GenerateConfig(temperature=temperature, top_k=None, top_p=1.0)
    max_new = get_task(task).max_answer_chars + 2
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def sample(number: int, messages: list[dict]) -> list[str]:
        ids = prompt_ids(tokenizer, messages, template)
        group = sample_group(
            model, ids, num_samples, max_new, sampling, rollout_generator(seed, number, device),
            tokenizer.eos_token_id, pad, prompt_number=number, kv=True,
        )  # fmt: skip
        return [tokenizer.decode(c, skip_special_tokens=False) for c in group.completions]

    return torch.no_grad()(sample)
