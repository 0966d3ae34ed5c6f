"""The chunked cross-entropy equals the plain one: loss and gradients, masks, autocast, whole models."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from suite.config.schema import ModelConfig, ParallelConfig
from suite.data.batch import Batch
from suite.models import build_model, materialize
from suite.parallel.dims import ParallelDims
from suite.parallel.placement import Placement
from suite.train.loss import HeadInput, chunked_cross_entropy, cross_entropy
from suite.train.step import TrainStep, training_loss


def plain_and_chunked(hidden, weight, targets, chunk):
    """(loss, d hidden, d weight) of the plain loss and of the chunked one."""
    out = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunked:
            loss = chunked_cross_entropy(h, w, targets, chunk)
        else:
            loss = F.cross_entropy((h @ w.t()).float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        out.append((loss.detach(), h.grad, w.grad))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 24, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_loss(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 8, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen) * 0.5
    targets = torch.randint(0, 50, (3, 8), generator=gen)
    targets[0, :3] = -100  # masked tokens (finetuning labels)
    (ref, ref_h, ref_w), (got, got_h, got_w) = plain_and_chunked(hidden, weight, targets, chunk)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_matches_the_plain_loss():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 16, 32, generator=gen), torch.randn(64, 32, generator=gen) * 0.2
    targets = torch.randint(0, 64, (2, 16), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (ref, ref_h, ref_w), (got, got_h, got_w) = plain_and_chunked(hidden, weight, targets, 5)
    assert got.dtype == torch.float32 and got_w.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_h, ref_h, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got_w, ref_w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("family", ["gpt", "llama"])  # tied head (gpt), untied head (llama)
def test_model_loss_with_chunks_equals_the_plain_model_loss(family):
    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_heads=4, vocab_size=96, max_seq_len=16)
    batch = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    batch[1, 12] = -100  # a masked target (the last token is a target only, never an input)
    results = []
    for chunk in (0, 5):
        model = materialize(build_model(cfg), "cpu", seed=3)
        placement = Placement(model=model, dims=ParallelDims.from_config(ParallelConfig(), 1))
        parallel = TrainStep(
            placement, None, training_loss(model, False), nullcontext, None, loss_chunk_tokens=chunk
        )
        micro = Batch.from_windows(batch)
        loss = parallel.model_loss(*parallel.model_inputs(micro), parallel.loss_weight([micro]))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_without_gradients_takes_the_chunked_path():
    hidden, weight = torch.randn(1, 6, 8), torch.randn(20, 8)
    targets = torch.randint(0, 20, (1, 6))
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, weight, targets, 4)
    ref = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_summed_chunked_loss_equals_the_summed_plain_loss():
    """reduction="sum": finetuning's token-weighted loss over the global batch."""
    hidden, weight = torch.randn(2, 6, 8, requires_grad=True), torch.randn(20, 8)
    targets = torch.randint(0, 20, (2, 6))
    targets[1, 2:] = -100
    got = cross_entropy(HeadInput(hidden, weight, 5), targets, reduction="sum")
    (got_h,) = torch.autograd.grad(got, hidden)
    ref = cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    (ref_h,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-6, atol=1e-6)
