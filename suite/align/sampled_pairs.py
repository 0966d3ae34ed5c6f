"""Preference pairs from the starting policy's own mistakes (align.data=task:<name>, align.pair_samples=N).

Swapping two digits of the right answer (suite.align.pairs.corrupt) makes a rejected answer the SFT model
mostly ranks below the right one already, so DPO learns little from it. Here the rejected answer is one
the model itself gives: for each training question, N answers are sampled from model.init_from (the
weights DPO starts from and its reference), and the most frequent wrong one (the first drawn among
equals) is paired, as `rejected`, with the task's answer as `chosen`. A question none of whose samples
is wrong falls back to the corrupted answer; their count is logged. Every data-parallel rank samples
the same answers (same weights, same generators), so the pairs agree.

Sampling is batched: the questions whose prompts have the same number of tokens are decoded together
(no padding), up to ROWS_PER_CALL answers per KV-cache call; one question per call took 18 minutes for
1,800 questions x 4 answers on a 2-core CPU (docs/benchmarks.md). Each question still draws from its
own generator, seeded by (train.seed, question number) as GRPO's rollouts are (suite.align.rollout), on
its own rows' logits: its answers are the ones it would get decoded alone, up to the floating-point
round-off a larger batch's matmuls may bring to the logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from suite.align.pairs import corrupt
from suite.align.rollout import rollout_generator
from suite.config.schema import GenerateConfig
from suite.data.chat import prompt_ids
from suite.data.tasks import generate_task, get_task, score
from suite.infer.generate import sample_with_logprobs
from suite.models import KVCache

ROWS_PER_CALL = 256  # answers decoded together (questions x align.pair_samples): bounds the KV cache

# (question numbers, each one's prompt chat messages) -> each question's sampled answers
Sampler = Callable[[list[int], list[list[dict]]], list[list[str]]]


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
    drawn = sample(list(range(len(rows))), [messages[:-1] for messages in rows])
    pairs, fallbacks = [], 0
    for messages, samples in zip(rows, drawn):
        answer = messages[-1]["content"]
        rejected = pick_rejected(samples, answer, name)
        if rejected is None:
            rejected, fallbacks = corrupt(answer), fallbacks + 1
        pairs.append({"prompt": messages[-2]["content"], "chosen": answer, "rejected": rejected})
    return pairs, fallbacks


@torch.no_grad()
def sample_answers(
    model: nn.Module,
    prompts: list[list[int]],
    num_samples: int,
    max_new_tokens: int,
    sampling: GenerateConfig,
    generators: list[torch.Generator],
    eos_id: int | None,
    pad_id: int,
) -> list[list[list[int]]]:
    """`num_samples` completions (ids, eos removed) of each of `prompts` (all of one length), decoded
    together with the KV cache; prompt i's rows draw from generators[i] exactly as
    suite.align.rollout.sample_group(kv=True) draws one prompt's group (rows past eos keep sampling)."""
    device = next(model.parameters()).device
    n, p = num_samples, len(prompts[0])
    rows = len(prompts) * n
    tokens = torch.tensor(prompts, dtype=torch.long, device=device).repeat_interleave(n, 0)
    drawn = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    live = torch.ones(rows, dtype=torch.bool, device=device)
    ended = torch.zeros(rows, dtype=torch.bool, device=device)  # eos drawn (kept as the last token)
    cache = KVCache.empty(model, batch=rows, max_len=p + max_new_tokens)
    logits = model(tokens, kv_cache=cache)[:, -1]
    for step in range(max_new_tokens):
        token = torch.cat(
            [
                sample_with_logprobs(logits[i * n : (i + 1) * n], sampling, generator)[0][:, 0]
                for i, generator in enumerate(generators)
            ]
        )
        drawn[live, step] = token[live]
        if eos_id is not None:
            ended |= live & (token == eos_id)
        fed = torch.where(live, token, torch.full_like(token, pad_id))
        live &= ~ended
        if step + 1 < max_new_tokens:
            logits = model(fed[:, None], kv_cache=cache)[:, -1]
    out: list[list[list[int]]] = []
    for i in range(len(prompts)):
        group = []
        for row in range(i * n, (i + 1) * n):
            ids = drawn[row].tolist()
            stop = next((t for t, tok in enumerate(ids) if tok == eos_id), None)
            group.append(ids[:stop] if stop is not None else ids)
        out.append(group)
    return out


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
    per_call = max(1, ROWS_PER_CALL // num_samples)

    def sample(numbers: list[int], conversations: list[list[dict]]) -> list[list[str]]:
        prompts = [prompt_ids(tokenizer, messages, template) for messages in conversations]
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(i)
        out: list[list[str]] = [[] for _ in prompts]
        was_training = model.training
        model.eval()
        try:
            for _, members in sorted(by_length.items()):
                for start in range(0, len(members), per_call):
                    chunk = members[start : start + per_call]
                    groups = sample_answers(
                        model, [prompts[i] for i in chunk], num_samples, max_new, sampling,
                        [rollout_generator(seed, numbers[i], device) for i in chunk],
                        tokenizer.eos_token_id, pad,
                    )  # fmt: skip
                    for i, group in zip(chunk, groups):
                        out[i] = [tokenizer.decode(c, skip_special_tokens=False) for c in group]
        finally:
            model.train(was_training)
        return out

    return torch.no_grad()(sample)
