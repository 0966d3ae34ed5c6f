"""Per-token log-probabilities of given tokens under a model's head, the quantity every alignment
method compares (the policy's, with gradients, and the reference's or the sampler's, without).

`target_logps(hidden, weight, targets)` is log p(targets[b, t]) from the final hidden states and the
head weight (what the forward's `head` hook receives), 0 where the target is IGNORE_INDEX;
`next_token_logps(hidden, weight, tokens)` is the same for targets = the next input token (the last
position, which has no next token in the row, gets 0). Both run in fp32, one row at a time, so the
fp32 logits of a whole micro-batch never exist at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from suite.data.batch import IGNORE_INDEX


def target_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[b, s] fp32 log-probabilities of `targets` ([b, s], IGNORE_INDEX where nothing is scored: 0 there)."""
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, 0)
    rows = []
    for b in range(hidden.shape[0]):
        logits = F.linear(hidden[b], weight).float()
        logp = logits.log_softmax(-1).gather(-1, safe[b, :, None]).squeeze(-1)
        rows.append(torch.where(keep[b], logp, 0.0))
    return torch.stack(rows)


def next_token_logps(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] fp32 log-probabilities of each position's next input token (the last position: 0)."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    return target_logps(hidden, weight, targets)
