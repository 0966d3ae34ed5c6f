"""The vocabulary-parallel distillation loss (tensor parallelism) equals the plain one: each "rank" (a
thread here, the all-reduces done through a barrier) holds half the vocabulary rows of both heads and
gets the whole loss, the whole d(hidden) and its own rows of d(weight). The real tp processes are in
tests/distributed/test_distill.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from suite.data.batch import IGNORE_INDEX
from suite.distill.divergence import DIVERGENCES, distill_loss
from suite.distill.vocab_parallel import VocabShard, vocab_rows
from tests.unit.test_distill_loss import reference


@dataclass
class _Exchange:
    """All-reduce between threads: each puts its tensor, waits, and reads the reduction."""

    size: int
    barrier: threading.Barrier = field(init=False)
    values: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.size)

    def reduce(self, rank: int, value: torch.Tensor, op) -> None:
        self.values[rank] = value.clone()
        self.barrier.wait()
        parts = [self.values[r] for r in range(self.size)]
        out = torch.stack(parts).amax(0) if op == dist.ReduceOp.MAX else torch.stack(parts).sum(0)
        self.barrier.wait()
        value.copy_(out)


@dataclass(frozen=True)
class ThreadShard(VocabShard):
    rank: int = 0
    exchange: _Exchange | None = None

    def reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self.exchange.reduce(self.rank, value, op)
        return value


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen)
    weight = torch.randn(vocab, 16, generator=gen)
    t_hidden = torch.randn(2, 7, 24, generator=gen)  # a wider teacher
    t_weight = torch.randn(vocab, 24, generator=gen)
    targets = torch.randint(0, vocab, (2, 7), generator=gen)
    targets[0, :3] = IGNORE_INDEX
    targets[1, :2] = torch.tensor([0, vocab - 1])  # labels in the first and the last rank's rows
    return hidden, weight, t_hidden, t_weight, targets


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("temperature,ce_weight", [(2.0, 0.3), (1.0, 0.0)])
def test_two_vocab_shards_give_the_whole_loss_and_gradients(kind, temperature, ce_weight):
    vocab, size = 50, 2
    hidden, weight, t_hidden, t_weight, targets = _inputs(vocab)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = reference(h, w, t_hidden, t_weight, targets, kind, temperature, ce_weight)
    want_h, want_w = torch.autograd.grad(want, (h, w))
    exchange, results = _Exchange(size), {}

    def rank(r: int) -> None:
        start, stop = vocab_rows(vocab, r, size)
        h_r = hidden.clone().requires_grad_()
        w_r = weight[start:stop].clone().requires_grad_()
        shard = ThreadShard(start, stop, None, r, exchange)
        loss = distill_loss(
            h_r, w_r, t_hidden, t_weight[start:stop], targets,
            kind=kind, temperature=temperature, ce_weight=ce_weight, chunk_tokens=5, shard=shard,
        )  # fmt: skip
        results[r] = (loss.detach(), *torch.autograd.grad(loss, (h_r, w_r)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1]
    for r in range(size):
        loss, grad_h, _ = results[r]
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_h, want_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([results[r][2] for r in range(size)]), want_w, rtol=1e-4, atol=1e-5)


def test_vocab_rows_follow_dtensor_shard0():
    assert [vocab_rows(512, r, 2) for r in range(2)] == [(0, 256), (256, 512)]
    assert [vocab_rows(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
