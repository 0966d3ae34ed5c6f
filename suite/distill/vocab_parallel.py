"""The distillation loss of vocabulary-sharded logits: tensor parallelism (parallel.tp > 1).

Under tp the output head is split on the vocabulary (suite.parallel.tensor_parallel): each rank holds
vocab/tp rows of the student's head weight (and of the teacher's), and every rank holds the whole
sequence's final hidden states. So each rank computes only its slice of both models' logits, and the
softmaxes and divergences need sums and maxima over the whole vocabulary: all-reduces over the tp
group, three per chunk of tokens (the maxima; the sums of exponentials with the hard-label logit; the
divergence sums). Autograd through those reductions would be wrong (a gradient arriving at a reduced
value is itself partial on each rank), so the gradient with respect to this rank's logit slice is
written out, each term exactly the derivative of suite.distill.divergence.token_losses (tested against it):

    with a = student / T, q = softmax(a), p = softmax(teacher / T), d loss / d student =
    (1 - ce_weight) * T * dD/da + ce_weight * (softmax(student) - onehot(label))
    forward_kl  dD/da = q - p
    reverse_kl  dD/da = q * (log q - log p - D)
    jsd         dD/da = q * ((log q - log m) - KL(q || m)) / 2

The step sums this rank's d(hidden) = grad @ W_slice over the tp group once per micro-batch
(suite.distill.divergence); d(W_slice) = grad^T @ hidden is this rank's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from suite.data.batch import IGNORE_INDEX


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [start, stop) of the vocabulary, and the tp group holding the others
    (group None: one rank holds the whole vocabulary; the reductions are then no-ops)."""

    start: int
    stop: int
    group: dist.ProcessGroup | None = None

    def reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(value, op=op, group=self.group)
        return value


def vocab_rows(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [start, stop) of a [vocab, hidden] weight that tp rank `rank` of `size` holds under
    DTensor's Shard(0) (torch.chunk: ceil(vocab / size) rows each, the last ranks fewer)."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def shard_losses(
    student: torch.Tensor,
    teacher: torch.Tensor,
    targets: torch.Tensor,
    kind: str,
    temperature: float,
    ce_weight: float,
    shard: VocabShard,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([tokens] loss, [tokens, rows] d loss / d student) of this rank's fp32 logit slices
    [tokens, rows] of the student and the teacher; 0 where the target is ignored. The loss is
    the whole vocabulary's, the same on every rank of the group."""
    keep = targets != IGNORE_INDEX
    t = temperature
    a, b = student / t, teacher / t
    top = shard.reduce(torch.stack([a.amax(-1), b.amax(-1)]), dist.ReduceOp.MAX)
    sums = [(a - top[0, :, None]).exp().sum(-1), (b - top[1, :, None]).exp().sum(-1)]
    if ce_weight:
        local = targets - shard.start
        mine = keep & (local >= 0) & (local < student.shape[1])
        index = torch.where(mine, local, 0)[:, None]
        top1 = top[0] * t  # max(student / T) * T = max(student): T > 0
        sums.append((student - top1[:, None]).exp().sum(-1))
        sums.append(torch.where(mine, student.gather(1, index)[:, 0], 0.0))  # the label's logit
    sums = shard.reduce(torch.stack(sums))
    log_q = a - (top[0] + sums[0].log())[:, None]
    log_p = b - (top[1] + sums[1].log())[:, None]
    q, p = log_q.exp(), log_p.exp()
    if kind == "forward_kl":
        div = shard.reduce((p * (log_p - log_q)).sum(-1))
        grad = q - p
    elif kind == "reverse_kl":
        ratio = log_q - log_p
        div = shard.reduce((q * ratio).sum(-1))
        grad = q * (ratio - div[:, None])
    elif kind == "jsd":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        parts = shard.reduce(torch.stack([(p * (log_p - log_m)).sum(-1), (q * (log_q - log_m)).sum(-1)]))
        div = 0.5 * (parts[0] + parts[1])
        grad = 0.5 * q * ((log_q - log_m) - parts[1][:, None])
    else:
        raise ValueError(f"distill.loss={kind!r}; use one of forward_kl, reverse_kl, jsd")
    loss = (1.0 - ce_weight) * t * t * div
    grad = grad * ((1.0 - ce_weight) * t)
    if ce_weight:
        lse = top1 + sums[2].log()
        loss = loss + ce_weight * (lse - sums[3])
        grad = grad + ce_weight * (student - lse[:, None]).exp()
        grad.scatter_add_(1, index, (-ce_weight * mine.to(grad.dtype))[:, None])
    return torch.where(keep, loss, 0.0), grad * keep[:, None]
