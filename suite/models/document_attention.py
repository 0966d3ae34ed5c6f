"""Attention inside packed documents without a [seq, seq] mask (`model.document_attention`).

A packed row holds several documents (suite.data.documents: a document is a run of equal ids in
`doc_ids`), and a token may attend only to earlier tokens of its own document: block-diagonal causal.

- `varlen` (the default): per-document SDPA. Each document of each row is one causal
  `F.scaled_dot_product_attention` call over its own rows of Q/K/V (no mask: the flash kernel, which
  never holds the score matrix), written into one output in sequence order. Memory is
  linear in the sequence length; the work is the documents' own causal triangles, less than the
  dense path's full seq x seq scores. A document's output is what it would be alone.
- `dense`: the boolean [b, 1, seq, seq] mask handed to SDPA, as before: quadratic memory (the mask,
  and SDPA's float copy of it, per row), kept as the reference and for comparison.

Why per-document SDPA and not flex attention with a document block mask: in torch 2.13 on CPU flex
attention has no backward ("FlexAttention does not support backward on CPU", checked on this
machine), so it cannot train here; and it avoids the score matrix only when compiled, which on CPU
needs inductor's C++ toolchain and recompiles as the documents' layout changes. Per-document SDPA
runs eagerly with torch's own kernels on every device and is exact in the sense that matters for
packing: a document's logits are the document's alone. Its cost is one kernel call per document,
small next to the matmuls when documents are hundreds of tokens long.

Context parallelism (suite.parallel.context_parallel) keeps its queries local and gathers every key;
`document_chunk_attention` runs one query chunk against the keys up to its end, per document (the
same piecewise function as without cp, so its backward recomputes per document too): a
document that started in an earlier chunk sees its earlier keys through causal masks of at most
[MASKED_QUERY_BLOCK, document length] (bounded by that document's length, not the sequence's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DOCUMENT_ATTENTIONS = ("varlen", "dense")  # model.document_attention

MASKED_QUERY_BLOCK = 512  # queries per SDPA call where a document needs a mask (under cp): its size bound
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # causal attention of one piece


def document_mask(
    doc_ids: torch.Tensor, query_index: torch.Tensor | None = None, key_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean [b, 1, q, k] mask (True = attend): same document and key not after the query.

    query_index / key_index: which sequence positions the queries / keys are (default: all, in
    order). Context parallelism passes its rank's query positions and every key position.
    """
    s = doc_ids.shape[-1]
    everything = torch.arange(s, device=doc_ids.device)
    q_index = everything if query_index is None else query_index
    k_index = everything if key_index is None else key_index
    q_doc, k_doc = doc_ids[:, q_index], doc_ids[:, k_index]
    causal = k_index[None, :] <= q_index[:, None]
    return ((q_doc[:, :, None] == k_doc[:, None, :]) & causal)[:, None]


def document_spans(doc_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of equal ids, in order: the documents of a packed row."""
    b, s = doc_ids.shape
    change = torch.ones(b, s + 1, dtype=torch.bool, device=doc_ids.device)
    change[:, 1:s] = doc_ids[:, 1:] != doc_ids[:, :-1]
    spans = []
    for row in change.cpu():
        cuts = row.nonzero().flatten().tolist()
        spans.append(list(zip(cuts[:-1], cuts[1:])))
    return spans


@dataclass(eq=False)
class Documents:
    """The packed documents of a micro-batch, handed to every attention layer in place of a mask.

    doc_ids: [b, S] over the whole sequence (under context parallelism too: each rank's attention
    picks its own queries); dense: build the [b, 1, q, k] mask (`model.document_attention=dense`)
    instead of attending per document. Spans and masks are computed once per forward and shared by
    the layers.
    """

    doc_ids: torch.Tensor
    dense: bool = False
    _spans: list[list[tuple[int, int]]] | None = field(default=None, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return self.doc_ids.shape[-1]

    def spans(self) -> list[list[tuple[int, int]]]:
        if self._spans is None:
            self._spans = document_spans(self.doc_ids)
        return self._spans

    @torch.compiler.disable
    def mask(self, query_index: torch.Tensor | None = None, key: object = None) -> torch.Tensor:
        """The dense boolean mask (queries: all, or `query_index` cached under `key`); eager under a
        compiled block (train.compile), like the per-document loop below."""
        if key not in self._masks:
            self._masks[key] = document_mask(self.doc_ids, query_index=query_index)
        return self._masks[key]


def causal_sdpa(gqa: bool) -> Attend:
    """Causal SDPA of one piece (queries and keys the same positions)."""
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)


Piece = tuple[int, int, int, int, int]  # (row, first query, end query, first key, end key)


def _attend_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, gqa: bool
) -> torch.Tensor:
    """Causal attention of queries that are the last q.shape[2] of the keys (`attend` when they are
    all of them; else SDPA with the bottom-right causal mask of this piece only)."""
    queries, keys = q.shape[2], k.shape[2]
    if queries == keys:
        return attend(q, k, v)
    mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class _PiecewiseAttention(torch.autograd.Function):
    """Attention piece by piece (one document, or its part in a query chunk) into one output, with a
    backward that recomputes each piece.

    Autograd through slices and a concatenation would keep every piece's output twice (the kernel's
    saved output and the concatenated copy) and, in backward, allocate a zero-filled full-size
    gradient for every slice. Here forward saves only Q/K/V and backward runs each piece's attention
    again under autograd (one extra attention forward, as the context-parallel attention does),
    writing its gradients into dq/dk/dv: memory is the output and the gradients. The pieces' queries
    cover every row of q exactly once; their keys may overlap (query blocks of one document), so key
    gradients add up.
    """

    @staticmethod
    def forward(ctx, q, k, v, pieces: list[Piece], attend: Attend, gqa: bool):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for i, q0, q1, k0, k1 in pieces:
            row = slice(i, i + 1)
            out[row, :, q0:q1] = _attend_piece(
                q[row, :, q0:q1], k[row, :, k0:k1], v[row, :, k0:k1], attend, gqa
            )
        ctx.save_for_backward(q, k, v)
        ctx.pieces, ctx.attend, ctx.gqa = pieces, attend, gqa
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq = torch.empty_like(q)  # every query row belongs to a piece
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # keys after the last query are nobody's
        for i, q0, q1, k0, k1 in ctx.pieces:
            row = slice(i, i + 1)
            piece = [
                t.detach().requires_grad_() for t in (q[row, :, q0:q1], k[row, :, k0:k1], v[row, :, k0:k1])
            ]
            with torch.enable_grad():
                out = _attend_piece(*piece, ctx.attend, ctx.gqa)
            grad_q, grad_k, grad_v = torch.autograd.grad(out, piece, grad_out[row, :, q0:q1])
            dq[row, :, q0:q1] = grad_q
            dk[row, :, k0:k1] += grad_k  # the query blocks of one document share its keys
            dv[row, :, k0:k1] += grad_v
        return dq, dk, dv, None, None, None


@torch.compiler.disable  # one call per document, data-dependent: a compiled block runs it eagerly
def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, attend: Attend
) -> torch.Tensor:
    """softmax(QK^T)V of every document on its own. q, k, v: [b, heads, S, d]; attend: causal attention."""
    if q.shape[2] != docs.seq_len or k.shape[2] != docs.seq_len:
        raise ValueError(
            f"document attention over {docs.seq_len} positions got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    pieces = [(i, s, e, s, e) for i, spans in enumerate(docs.spans()) for s, e in spans]
    return _PiecewiseAttention.apply(q, k, v, pieces, attend, False)


def document_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, start: int, gqa: bool
) -> torch.Tensor:
    """Queries at sequence positions [start, end) against the keys [0, end), per document.

    q: [b, heads, end - start, d]; k, v: [b, kv heads, >= end, d] in sequence order. A document that
    begins inside the chunk is plain causal attention; one that began earlier attends from its own
    start with the queries aligned to the bottom right of its keys, MASKED_QUERY_BLOCK queries at a
    time (each block's mask is [block, its keys]: linear in the document's length).
    """
    end = start + q.shape[2]
    pieces = []
    for i, spans in enumerate(docs.spans()):
        for s, e in spans:
            if e <= start or s >= end:
                continue
            q_from, q_to = max(s, start), min(e, end)
            # a document begun before the chunk needs a mask: bound it by cutting the queries into
            # blocks, each the last queries of its own keys (the mask is [block, keys], not [chunk, keys])
            step = q_to - q_from if q_from == s else MASKED_QUERY_BLOCK
            for a in range(q_from, q_to, step):
                b_ = min(a + step, q_to)
                pieces.append((i, a - start, b_ - start, s, b_))
    return _PiecewiseAttention.apply(q, k, v, pieces, causal_sdpa(gqa), gqa)
