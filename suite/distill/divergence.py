"""The distillation loss, computed chunk by chunk over tokens so neither model's full-vocabulary
distribution ever exists for a whole micro-batch.

Per target token (labels not IGNORE_INDEX), with p = softmax(teacher / T) and q = softmax(student / T):

    loss = ce_weight * CE(student, label) + (1 - ce_weight) * T^2 * D(p, q)
    D = forward_kl: KL(p || q)   reverse_kl: KL(q || p)   jsd: (KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2

(T^2 keeps the soft-target gradients on the scale of the hard-label ones, as in Hinton et al.)
The sum over tokens is returned; the step multiplies it by its global-batch weight. Like
suite.train.loss.chunked_cross_entropy, each chunk's gradient with respect to the student's hidden
states and head weight is computed right there (autograd on the chunk's logits only), so the
backward is two stored tensors and no recompute.

Under tensor parallelism the head weights are vocabulary-sharded: each chunk's loss and logit
gradient come from suite.distill.vocab_parallel (reductions over the tp group), and d(hidden) is
summed over the group once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from suite.data.batch import IGNORE_INDEX
from suite.distill.vocab_parallel import VocabShard, shard_losses

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def token_losses(
    student: torch.Tensor,
    teacher: torch.Tensor,
    targets: torch.Tensor,
    kind: str,
    temperature: float,
    ce_weight: float,
) -> torch.Tensor:
    """[tokens] distillation loss of fp32 logits [tokens, vocab] (0 where the target is ignored)."""
    keep = targets != IGNORE_INDEX
    log_q = F.log_softmax(student / temperature, dim=-1)
    log_p = F.log_softmax(teacher / temperature, dim=-1)
    if kind == "forward_kl":
        div = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif kind == "reverse_kl":
        div = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_p, log_q]), dim=0) - torch.log(torch.tensor(2.0))
        div = 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))
    else:
        raise ValueError(f"distill.loss={kind!r}; use one of {', '.join(DIVERGENCES)}")
    loss = (1.0 - ce_weight) * temperature**2 * div
    if ce_weight:
        ce = F.cross_entropy(student, torch.where(keep, targets, 0), reduction="none")
        loss = loss + ce_weight * ce
    return torch.where(keep, loss, 0.0)


class _ChunkedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, targets, chunk, kind, temperature, ce_weight, shard):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            student = (h @ weight.t()).float().requires_grad_()
            teacher = (t_hidden[start : start + chunk] @ t_weight.t()).float()
            if shard is not None:  # vocabulary-sharded logits (tp): reductions over the group
                loss, grad = shard_losses(
                    student.detach(),
                    teacher,
                    targets[start : start + chunk],
                    kind,
                    temperature,
                    ce_weight,
                    shard,
                )
                loss = loss.sum()
            else:
                with torch.enable_grad():
                    loss = token_losses(
                        student, teacher, targets[start : start + chunk], kind, temperature, ce_weight
                    )
                    loss = loss.sum()
                    (grad,) = torch.autograd.grad(loss, student) if (need_hidden or need_weight) else (None,)
            total += loss.detach()
            if grad is not None:
                grad = grad.to(h.dtype)
                if need_hidden:
                    grad_hidden[start : start + chunk] = grad @ weight
                if need_weight:
                    grad_weight += grad.t() @ h
        if shard is not None and need_hidden:  # each rank's vocabulary rows add to d(hidden)
            shard.reduce(grad_hidden)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def distill_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    ce_weight: float = 0.5,
    chunk_tokens: int = 1024,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Summed distillation loss of the student's final hidden states [b, s, h] and head weight
    [vocab, h] against the teacher's ([b, s, h_t], [vocab, h_t]); gradients reach the student only.

    `shard` (tensor parallelism): both weights are this rank's vocabulary rows, the hidden states
    whole; the loss is the whole vocabulary's (suite.distill.vocab_parallel).
    Under autocast the projections run in the autocast dtype, as nn.Linear would; the losses in fp32.
    """
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    flat = lambda t: t.flatten(0, -2).to(dtype)  # noqa: E731
    with torch.autocast(device_type, enabled=False):
        return _ChunkedDistill.apply(
            flat(hidden),
            weight.to(dtype),
            flat(teacher_hidden.detach()),
            teacher_weight.detach().to(dtype),
            targets.flatten(),
            max(1, chunk_tokens),
            kind,
            float(temperature),
            float(ce_weight),
            shard,
        )
