"""model.document_attention=varlen: packed documents attend on their own, without a [seq, seq] mask,
and compute what the dense mask does (the attention alone, a cp chunk, the model, a few training steps)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.data.batch import Batch
from suite.data.documents import document_ids
from suite.models import build_model, materialize
from suite.models.checks import check_model
from suite.models.document_attention import (
    Documents,
    causal_sdpa,
    document_attention,
    document_chunk_attention,
    document_mask,
    document_spans,
)
from suite.models.transformer import explicit_attention

EOS = 0


def _ids(seq: int = 40, rows: int = 2, seed: int = 0) -> torch.Tensor:
    """Rows of ~6 documents each, one of them running over most of the second row."""
    tokens = torch.randint(0, 7, (rows, seq), generator=torch.Generator().manual_seed(seed))
    tokens[-1, 5:] = 3  # a long document: crosses every chunk boundary of a cp split
    return document_ids(tokens, EOS)


def _qkv(ids: torch.Tensor, heads: int = 4, kv_heads: int = 2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    b, s = ids.shape
    return [
        torch.randn(b, h, s, 8, generator=gen, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]


def test_spans_are_the_runs_of_equal_ids():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2], [-1, -1, -1, -1, -1, -1]])
    assert document_spans(ids) == [[(0, 3), (3, 4), (4, 6)], [(0, 6)]]


@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "explicit"])
def test_per_document_attention_and_its_gradients_equal_the_dense_mask(explicit):
    ids = _ids()
    q, k, v = _qkv(ids)
    attend = (lambda q_, k_, v_: explicit_attention(q_, k_, v_)) if explicit else causal_sdpa(True)
    ours = document_attention(q, k, v, Documents(ids), attend)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=True)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block", [512, 2])  # MASKED_QUERY_BLOCK: whole chunk parts, or 2 queries per call
def test_a_context_parallel_chunk_sees_the_rows_of_the_dense_mask(block, monkeypatch):
    """Queries [start, end) against the keys before `end`: each chunk of a 4-way cp split."""
    monkeypatch.setattr("suite.models.document_attention.MASKED_QUERY_BLOCK", block)
    ids = _ids()
    q, k, v = _qkv(ids)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=True)
    size = ids.shape[1] // 8
    for chunk in range(8):
        start, end = chunk * size, (chunk + 1) * size
        q_chunk = q.detach()[:, :, start:end].requires_grad_()
        got = document_chunk_attention(q_chunk, k, v, Documents(ids), start, gqa=True)
        torch.testing.assert_close(got, ref[:, :, start:end], rtol=0, atol=1e-12)
        grad = torch.randn_like(got)
        mine = torch.autograd.grad(got, (q_chunk, k, v), grad)
        want = torch.autograd.grad(ref[:, :, start:end], (q, k, v), grad, retain_graph=True)
        torch.testing.assert_close(mine[0], want[0][:, :, start:end], rtol=0, atol=1e-12)
        for a, b in zip(mine[1:], want[1:]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


CFG = ModelConfig(family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128)


def test_the_model_refuses_an_unknown_document_attention_and_a_mask_with_doc_ids():
    with pytest.raises(ConfigError, match="model.document_attention='flex'"):
        check_model(dataclasses.replace(CFG, document_attention="flex"))
    model = materialize(build_model(CFG), "cpu", seed=0)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="either mask or doc_ids"):
        model(torch.ones(1, 8, dtype=torch.long), mask=document_mask(ids), doc_ids=ids)


def _train(cfg: ModelConfig, steps: int = 3) -> list[float]:
    """SGD steps on packed rows (documents end with EOS), through Batch.model_kwargs like the trainer."""
    model = materialize(build_model(cfg), "cpu", seed=0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = torch.randint(0, 12, (3, 65), generator=torch.Generator().manual_seed(2))  # ~6 documents a row
    batch = Batch.from_windows(rows, EOS)
    losses = []
    for _ in range(steps):
        logits = model(batch.tokens, **batch.model_kwargs())
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_training_losses_equal_the_dense_mask_path(family):
    cfg = dataclasses.replace(CFG, family=family)
    varlen = _train(dataclasses.replace(cfg, document_attention="varlen"))
    dense = _train(dataclasses.replace(cfg, document_attention="dense"))
    assert varlen[-1] < varlen[0]
    torch.testing.assert_close(torch.tensor(varlen), torch.tensor(dense), rtol=1e-5, atol=0)


@pytest.mark.parametrize("granularity", ["full", "core_attn"])
def test_recomputed_blocks_attend_per_document_with_the_same_gradients(granularity):
    """recompute=full / core_attn checkpoints blocks or the core: the batch's Documents pass through."""
    from suite.config.schema import RecomputeConfig
    from suite.parallel.recompute import apply_recompute

    rows = torch.randint(0, 12, (2, 33), generator=torch.Generator().manual_seed(3))
    batch = Batch.from_windows(rows, EOS)
    grads = []
    for recompute in (None, granularity):
        model = materialize(build_model(CFG), "cpu", seed=0).train()
        if recompute:
            apply_recompute(model, RecomputeConfig(granularity=recompute))
        logits = model(batch.tokens, **batch.model_kwargs())
        F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_blocks_attend_per_document():
    """train.compile compiles each block: the per-document loop runs eagerly between its graphs."""
    cfg = dataclasses.replace(CFG, num_layers=1)
    eager, compiled = (materialize(build_model(cfg), "cpu", seed=0) for _ in range(2))
    for block in compiled.layers.values():
        block.compile()
    for seed in (4, 5):  # another document layout: no recompilation needed to stay right
        rows = torch.randint(0, 12, (2, 33), generator=torch.Generator().manual_seed(seed))
        batch = Batch.from_windows(rows, EOS)
        torch.testing.assert_close(
            compiled(batch.tokens, **batch.model_kwargs()),
            eager(batch.tokens, **batch.model_kwargs()),
            rtol=1e-5,
            atol=1e-5,
        )
