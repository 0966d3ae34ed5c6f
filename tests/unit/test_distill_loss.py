"""The chunked distillation loss equals the same loss written plainly with autograd, for every
divergence, in value and in the student's gradients; the teacher gets none."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from suite.data.batch import IGNORE_INDEX
from suite.distill.divergence import DIVERGENCES, distill_loss


def reference(hidden, weight, t_hidden, t_weight, targets, kind, temperature, ce_weight):
    s = (hidden @ weight.t()).flatten(0, 1).float()
    t = (t_hidden @ t_weight.t()).flatten(0, 1).float()
    p, q = F.softmax(t / temperature, -1), F.softmax(s / temperature, -1)
    if kind == "forward_kl":
        div = (p * (p.log() - q.log())).sum(-1)
    elif kind == "reverse_kl":
        div = (q * (q.log() - p.log())).sum(-1)
    else:
        m = (p + q) / 2
        div = 0.5 * (p * (p.log() - m.log())).sum(-1) + 0.5 * (q * (q.log() - m.log())).sum(-1)
    flat = targets.flatten()
    keep = flat != IGNORE_INDEX
    ce = F.cross_entropy(s, torch.where(keep, flat, 0), reduction="none")
    per_token = ce_weight * ce + (1 - ce_weight) * temperature**2 * div
    return per_token[keep].sum()


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("chunk", [3, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_loss(kind, chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    t_hidden = torch.randn(2, 7, 24, generator=gen)  # a wider teacher
    t_weight = torch.randn(50, 24, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    targets[0, :3] = IGNORE_INDEX  # a prompt: no loss there
    args = (hidden, weight, t_hidden, t_weight, targets)
    want = reference(*args, kind, 2.0, 0.3)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got = distill_loss(*args, kind=kind, temperature=2.0, ce_weight=0.3, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert t_weight.grad is None  # the teacher is frozen


def test_a_student_equal_to_its_teacher_has_no_divergence():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(1, 5, 8, generator=gen), torch.randn(30, 8, generator=gen)
    targets = torch.randint(0, 30, (1, 5), generator=gen)
    for kind in DIVERGENCES:
        loss = distill_loss(hidden, weight, hidden, weight, targets, kind=kind, ce_weight=0.0)
        assert abs(float(loss)) < 1e-5, (kind, float(loss))
    pure_ce = distill_loss(hidden, weight, hidden, weight, targets, ce_weight=1.0)
    torch.testing.assert_close(
        pure_ce, F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="sum")
    )
