"""Context (sequence) parallelism: every activation of a sequence is split across the cp ranks.

Layout (load-balanced causal chunking). A row of S positions is cut into 2*cp chunks of
L = S / (2*cp); cp rank r holds chunks r and 2*cp-1-r, an early and a late one, so that under the
causal mask every rank does the same attention work ((2*cp+1) * L^2 scores). The batch is split
before the embedding (`split_batch`: tokens, targets, the real positions of the rank's tokens for
RoPE and learned positions, and the whole rows' document ids when documents are packed) and the
loss is the mean over the rank's tokens; the data-parallel wrapper averages gradients over
dp x sharding x cp, which makes the gradient that of the mean over every token of the global batch.

Attention: all-gather of K/V (`ContextParallelAttention` replaces each block's `CoreAttention`).
Queries stay local; the K/V of every rank are gathered along the cp group and put back in sequence
order, and each of the rank's two query chunks attends to the keys up to its end (chunk c:
keys [0, (c+1)*L), causal inside the diagonal block), with the same SDPA kernel as one process.
The backward gathers K/V again, recomputes those two attention calls, and reduce-scatters dK/dV
to the ranks that own them (the exact adjoint of the gather). Only the local Q/K/V are kept for
backward, so every saved activation shrinks with cp; the gathered K/V (2 * S * kv_dim per layer)
exist only while one layer's attention runs.

Why all-gather and not a ring: it is exact with the same kernel as one process (no online-softmax
merge whose rounding differs from it), any mask composes with it (documents just index the
gathered keys, per document or as rows of a dense mask), it needs one collective per layer instead
of cp-1 dependent steps (a ring's win is overlapping its steps with compute, which gloo on CPU
cannot do), and with grouped-query attention K/V are a small fraction of the activations. Its cost
is the transient gathered K/V, which a ring would bound to two blocks: at very long sequences (K/V
of S tokens per layer no longer fitting) a ring is the better algorithm.
"""

from __future__ import annotations

import functools
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from suite.data.batch import Batch
from suite.models.document_attention import Documents, document_chunk_attention
from suite.models.mtp import mtp_targets
from suite.parallel.context_parallel_moe import apply_context_parallel_moe


def chunk_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sequence positions cp rank `rank` holds, in its local order: chunk r, then chunk 2*cp-1-r."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp}")
    size = seq_len // (2 * cp)
    early = torch.arange(rank * size, (rank + 1) * size, device=device)
    late = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size, device=device)
    return torch.cat([early, late])


def split_batch(
    batch: Batch, cp: int, rank: int, mtp_depths: int = 0
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This rank's part of a micro-batch: (tokens, targets, forward kwargs with positions and doc ids).

    Positions are the chunks' own (the batch's positions, or their index in the sequence); without
    documents attention is causal; with documents the kwargs carry the whole rows' `doc_ids` [b, S]
    (small next to any mask), from which each rank's attention takes its queries' documents.
    mtp_depths > 0 (multi-token prediction): the kwargs carry the chunks' `mtp_targets`, the later
    tokens of each position taken from the whole row (suite.models.mtp).
    """
    index = chunk_index(batch.tokens.shape[1], cp, rank, batch.tokens.device)
    kwargs: dict = {"positions": index if batch.positions is None else batch.positions[:, index]}
    if batch.doc_ids is not None:
        kwargs["doc_ids"] = batch.doc_ids
    if mtp_depths:
        kwargs["mtp_targets"] = mtp_targets(batch.tokens, mtp_depths)[:, :, index]
    return batch.tokens[:, index], batch.labels[:, index], kwargs


# ---- the collectives: K/V gathered into sequence order, gradients scattered back -------------------
def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[b, h, 2L, d] local chunks of every rank -> [b, h, 2*cp*L, d] in sequence order."""
    b, h, two_l, d = x.shape
    size = two_l // 2
    buf = x.new_empty(cp * x.numel())
    dist.all_gather_single(buf, x.contiguous().view(-1), group=group)
    parts = buf.view(cp, b, h, 2, size, d)
    early = parts[:, :, :, 0]  # rank j's early chunk is chunk j
    late = parts[:, :, :, 1].flip(0)  # rank j's late chunk is chunk 2*cp-1-j
    ordered = torch.cat([early, late])  # [2cp, b, h, L, d], chunk order
    return ordered.permute(1, 2, 0, 3, 4).reshape(b, h, 2 * cp * size, d)


def _scatter_sequence(grad: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """Adjoint of `_gather_sequence`: sum every rank's [b, h, S, d] and keep this rank's chunks."""
    b, h, seq, d = grad.shape
    size = seq // (2 * cp)
    chunks = grad.view(b, h, 2 * cp, size, d).permute(2, 0, 1, 3, 4)  # [2cp, b, h, L, d]
    send = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=3)  # [cp, b, h, 2, L, d]: per rank
    out = grad.new_empty(b, h, 2 * size, d)
    dist.reduce_scatter_single(out.view(-1), send.contiguous().view(-1), op=dist.ReduceOp.SUM, group=group)
    return out


@lru_cache(maxsize=64)
def _diagonal_causal(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] causal mask aligned to the bottom right (the queries are the last positions)."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def _two_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Documents | None,
    cp: int,
    rank: int,
    gqa: bool,
) -> torch.Tensor:
    """Local queries (chunks rank, 2cp-1-rank) against the full-sequence keys, each chunk up to its end.

    mask: None (causal), the [b, 1, 2L, S] dense document mask, or `Documents` (per document)."""
    size = q.shape[2] // 2
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        keys = (chunk + 1) * size
        rows = slice(half * size, (half + 1) * size)
        if isinstance(mask, Documents):
            outs.append(document_chunk_attention(q[:, :, rows], k, v, mask, chunk * size, gqa))
            continue
        if mask is None:
            chunk_mask = _diagonal_causal(size, keys, q.device)
        else:
            chunk_mask = mask[..., rows, :keys]
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, rows], k[:, :, :keys], v[:, :, :keys], attn_mask=chunk_mask, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


class _AllGatherAttention(torch.autograd.Function):
    """softmax(QK^T)V over the whole sequence for this rank's queries, with an exact backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, group, cp, rank, gqa):
        k_all, v_all = _gather_sequence(k, group, cp), _gather_sequence(v, group, cp)
        out = _two_chunk_attention(q, k_all, v_all, mask, cp, rank, gqa)
        ctx.save_for_backward(q, k, v)
        ctx.args = (mask, group, cp, rank, gqa)  # the mask: an input without gradient, or Documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        mask, group, cp, rank, gqa = ctx.args
        k_all, v_all = _gather_sequence(k, group, cp), _gather_sequence(v, group, cp)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k_all, v_all))
            out = _two_chunk_attention(q_, k_, v_, mask, cp, rank, gqa)
            dq, dk_all, dv_all = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        dk, dv = _scatter_sequence(dk_all, group, cp), _scatter_sequence(dv_all, group, cp)
        return dq, dk, dv, None, None, None, None, None


class ContextParallelAttention(nn.Module):
    """Drop-in for the model's CoreAttention when the sequence is split across a cp group.

    q, k, v: [b, heads, 2L, head_dim] of this rank's two chunks; mask: None (causal), a
    [b, 1, 2L, S] boolean mask of the rank's queries against every key, or the batch's `Documents`
    over the whole sequence (model.document_attention: varlen attends per document, dense builds the
    [b, 1, 2L, S] rows of the document mask). A KV-cache decode (q of one token, keys longer than
    the local sequence) is not context parallel: it is refused.
    """

    def __init__(self, gqa: bool, group: dist.ProcessGroup, cp: int, rank: int):
        super().__init__()
        self.gqa, self.group, self.cp, self.rank = gqa, group, cp, rank

    # A compiled block (train.compile) breaks its graph here and runs this call eagerly: the
    # collectives live inside a custom autograd Function (gather forward, reduce-scatter backward),
    # which the compiler does not trace. The projections, RoPE, norms and the MLP around it compile.
    @torch.compiler.disable
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if k.shape[2] != q.shape[2] or q.shape[2] % 2:
            raise RuntimeError(
                "context-parallel attention expects this rank's two sequence chunks for q, k and v "
                f"(got q {tuple(q.shape)}, k {tuple(k.shape)}); decoding with a KV cache is not context parallel"
            )
        if isinstance(mask, Documents) and mask.dense:
            index = chunk_index(mask.seq_len, self.cp, self.rank, q.device)
            mask = mask.mask(query_index=index, key=("cp", self.cp, self.rank))
        return _AllGatherAttention.apply(q, k, v, mask, self.group, self.cp, self.rank, self.gqa)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Swap every block's CoreAttention for the cp-aware one and sum MoE router statistics over the
    cp group (in place; parameter names unchanged)."""
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    mtp = list(getattr(model, "mtp", None) or {})
    blocks = [*model.layers.values(), *(model.mtp[k].block for k in mtp)]
    for block in blocks:
        attention = block.attention
        attention.core = ContextParallelAttention(attention.core.gqa, group, cp, rank)
    for key in mtp:  # multi-token prediction: each depth's mean over the whole row's targets
        model.mtp[key].count_tokens = functools.partial(_per_rank_count, group, cp)
    apply_context_parallel_moe(model, group)  # MoE layers: the balance loss over the whole sequence


@torch.no_grad()
def _per_rank_count(group: dist.ProcessGroup, cp: int, count: torch.Tensor) -> torch.Tensor:
    """The whole row's target count / cp: a rank's summed loss over it, averaged over the cp ranks
    (as the gradients and the logged loss are), is the whole row's mean."""
    total = count.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / cp
