"""Documents inside packed pretraining rows (`data.doc_mask=true`).

`suite prepare` writes every document followed by one EOS token, and the loader cuts fixed windows
out of that stream, so a row usually holds the end of one document, some whole ones and the start
of another. With document masking each of them is seen as if it were alone: positions restart at
0 after every EOS, and attention is block-diagonal causal (a token attends to earlier tokens of its
own document only). The EOS token belongs to the document it ends; the token after it starts the
next one. The loss is unchanged (every position is still a target, EOS -> next document included),
as in Megatron-LM's `reset_position_ids` + `reset_attention_mask`. Batches carry the ids; the model
keeps attention inside documents (suite.models.document_attention: per document, or a dense mask).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, s] document number of each position within its row (0 for the first, +1 after each EOS)."""
    ends = (tokens == eos_id).long()
    return torch.cumsum(ends, dim=-1) - ends  # the EOS itself still belongs to its document


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] position of each token within its document (restarting at 0 where the id changes)."""
    s = doc_ids.shape[-1]
    index = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # index of the first token of each position's document: a running max over document starts
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    return index - first
