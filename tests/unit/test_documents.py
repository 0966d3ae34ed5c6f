"""data.doc_mask: packed pretraining rows behave as if each document were alone (no processes)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from suite.config.schema import ModelConfig
from suite.data.batch import Batch
from suite.data.documents import document_ids, document_positions
from suite.models import build_model, materialize
from suite.models.document_attention import Documents, document_mask
from suite.parallel.context_parallel import chunk_index, split_batch
from suite.parallel.dims import ParallelDims
from suite.parallel.placement import Placement
from suite.train.step import TrainStep

EOS = 0


def test_documents_split_after_eos_with_positions_restarting():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 3]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]  # EOS closes its own document
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    mask = document_mask(ids)[0, 0]
    assert mask.shape == (9, 9)
    assert mask[5].tolist() == [False] * 3 + [True] * 3 + [False] * 3  # own document, causal
    assert not mask.triu(1).any()


def test_context_parallel_chunks_are_load_balanced_and_cover_the_sequence():
    cp, seq = 4, 16
    parts = [chunk_index(seq, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # equal causal work per rank: sum over its queries of the keys they see
    assert len({int((p + 1).sum()) for p in parts}) == 1
    tokens = torch.tensor([[1, 2, EOS, 4, 5, 6, EOS, 8] * 2])
    ids = document_ids(tokens, EOS)
    local, targets, kwargs = split_batch(Batch(tokens, tokens + 1, document_positions(ids), ids), cp, 1)
    index = chunk_index(seq, cp, 1)
    assert torch.equal(local, tokens[:, index]) and torch.equal(targets, tokens[:, index] + 1)
    assert torch.equal(kwargs["positions"], document_positions(ids)[:, index])
    assert torch.equal(kwargs["doc_ids"], ids)  # the whole rows: each rank's attention picks its queries
    dense_rows = Documents(ids, dense=True).mask(query_index=index, key="rank 1")
    assert torch.equal(dense_rows, document_mask(ids)[:, :, index])  # rows of the full mask
    plain = split_batch(Batch(tokens, tokens), cp, 1)[2]  # no documents: real positions, causal attention
    assert list(plain) == ["positions"] and torch.equal(plain["positions"], index)


@pytest.mark.parametrize("document_attention", ["varlen", "dense"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_document_has_the_same_logits_packed_or_alone(family, document_attention):
    """Through the trainer's batch path (suite.train.step.TrainStep.model_inputs): positions restart, the mask is
    block-diagonal, so a document's logits do not depend on what it is packed with."""
    cfg = ModelConfig(
        family=family,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        max_seq_len=128,
        document_attention=document_attention,
    )
    model = materialize(build_model(cfg), "cpu", seed=3).eval()
    dims = ParallelDims(dp=1, sharding=1, tp=1, pp=1, cp=1, ep=1, world_size=1)
    runner = TrainStep(Placement(model=model, dims=dims), None, None, nullcontext, None)
    gen = torch.Generator().manual_seed(0)
    before, doc, after = (torch.randint(1, 512, (n,), generator=gen) for n in (37, 21, 30))
    eos = torch.tensor([EOS])
    alone = torch.cat([doc, eos, after[:1]])[None]  # [1, s + 1]: the document, its EOS, one more target
    packed = torch.cat([before, eos, doc, eos, after])[None]
    start, length = len(before) + 1, len(doc) + 1  # where the document (with its EOS) sits in the row
    with torch.no_grad():
        tokens, _, kwargs = runner.model_inputs(Batch.from_windows(alone, EOS))
        ref = model(tokens, **kwargs)[0, :length]
        tokens, _, kwargs = runner.model_inputs(Batch.from_windows(packed, EOS))
        got = model(tokens, **kwargs)[0, start : start + length]
        leaky = model(packed[:, :-1])[0, start : start + length]  # no document mask: it sees `before`
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert (leaky - ref).abs().max() > 1e-2
