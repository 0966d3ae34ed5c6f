"""Next-token cross-entropy, optionally over chunks of tokens so the full logits never exist.

The plain loss materialises logits of [tokens, vocab] in the compute dtype and again in fp32 (plus the
same again for their gradient): for batch 4 x 512 tokens and a 32k vocabulary that is ~0.4 GB before
the backward. `chunked_cross_entropy` runs the output projection and the loss over `chunk_tokens`
tokens at a time and computes each chunk's gradients right there (softmax minus one-hot is known as
soon as the chunk's log-sum-exp is), keeping only d(hidden) and d(weight) for the backward: the same
three matmuls as the plain loss, no recompute, and one chunk of logits alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from suite.data.batch import IGNORE_INDEX


@dataclass
class HeadInput:
    """What the output head would turn into logits: final hidden states [b, s, h] and the head's weight
    [vocab, h]. The loss computes the logits itself, `chunk_tokens` tokens at a time."""

    hidden: torch.Tensor
    weight: torch.Tensor
    chunk_tokens: int


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, ignore_index: int, mean: bool):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        count = (targets != ignore_index).sum() if mean else torch.ones((), device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            t = targets[start : start + chunk_tokens]
            keep = t != ignore_index
            safe_t = torch.where(keep, t, 0)[:, None]
            # Few passes over the [chunk, vocab] logits, the loss's whole non-matmul cost: exp(logits - max)
            # is computed once, in place, and serves both the log-sum-exp and the softmax gradient.
            logits = (h @ weight.t()).float()
            row_max = logits.amax(dim=-1, keepdim=True)
            target_logit = logits.gather(1, safe_t)
            exp = logits.sub_(row_max).exp_()
            sum_exp = exp.sum(dim=-1, keepdim=True)
            lse = row_max + sum_exp.log()
            total += torch.where(keep[:, None], lse - target_logit, 0.0).sum()
            if need_hidden or need_weight:
                scale = keep[:, None] / sum_exp  # softmax normalisation and the ignore mask, one factor
                # softmax - one-hot at the targets, computed in fp32 and rounded once into h's dtype
                target_grad = exp.gather(1, safe_t) * scale - keep[:, None].float()
                grad = exp.mul_(scale).to(h.dtype).scatter_(1, safe_t, target_grad.to(h.dtype))
                if need_hidden:
                    grad_hidden[start : start + chunk_tokens] = grad @ weight
                if need_weight:
                    grad_weight += grad.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_output / count
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy (mean or sum) of logits `hidden @ weight.T` against `targets`, in fp32,
    `chunk_tokens` tokens at a time.

    Equal to `F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=..., reduction=...)`
    (and so are its gradients); under autocast the projection runs in the autocast dtype, as
    `nn.Linear` would.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; use mean or sum")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    h = hidden.flatten(0, -2).to(dtype)
    w = weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        mean = reduction == "mean"
        return _ChunkedLinearCrossEntropy.apply(h, w, targets.flatten(), chunk_tokens, ignore_index, mean)


def cross_entropy(
    logits: torch.Tensor | HeadInput, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Next-token loss in fp32 ("mean" or "sum"); targets of -100 (masked tokens) contribute nothing.

    `logits` is either the logits [b, s, vocab] or a HeadInput (train.loss_chunk_tokens > 0).
    """
    if isinstance(logits, HeadInput):
        return chunked_cross_entropy(
            logits.hidden, logits.weight, targets, logits.chunk_tokens, reduction=reduction
        )
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )
