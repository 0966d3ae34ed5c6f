"""The one micro-batch type every training path consumes: pretraining windows and SFT rows alike.

A `Batch` holds [b, s] int64 tensors: the model's input tokens, the target of every position
(already shifted; IGNORE_INDEX where nothing is learned), and optionally the positions and the
document ids of packed rows. Pretraining windows come from `Batch.from_windows` (every position
is a target; with `eos_id`, positions restart after each EOS and document ids keep attention
inside documents); SFT rows come from `suite.data.sft.SFTDataset.batch` (prompt and padding
targets ignored, packed samples as documents). The step (suite.train.step) reads only this type:
one loss weighted by target tokens, one mask, one way to split a batch for context parallelism
and to feed pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from suite.data.documents import document_ids, document_positions

IGNORE_INDEX = -100  # the target of a position that contributes nothing to the loss


@dataclass
class Batch:
    """One micro-batch. Every tensor is [b, s] int64.

    tokens: model inputs; labels: the target of tokens[t] (already shifted), IGNORE_INDEX where
    nothing is learned; positions: each token's position (None: 0..s-1); doc_ids: the document
    number of each position within its row, -1 for padding (None: one document per row, the
    plain causal mask).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    @classmethod
    def from_windows(cls, rows: torch.Tensor, eos_id: int | None = None) -> Batch:
        """Pretraining token windows [b, s + 1] (inputs and shifted targets in one tensor).

        eos_id (data.doc_mask): the documents inside each window are seen as if alone, as in
        Megatron-LM's reset_position_ids + reset_attention_mask (suite.data.documents).
        """
        tokens, labels = rows[:, :-1], rows[:, 1:]
        if eos_id is None:
            return cls(tokens, labels)
        doc_ids = document_ids(tokens, eos_id)
        return cls(tokens, labels, document_positions(doc_ids), doc_ids)

    @classmethod
    def cat(cls, batches: list[Batch]) -> Batch:
        """The micro-batches stacked along the batch dimension (a pipeline schedule splits them again)."""
        join = lambda name: (  # noqa: E731
            None if getattr(batches[0], name) is None else torch.cat([getattr(b, name) for b in batches])
        )
        return cls(join("tokens"), join("labels"), join("positions"), join("doc_ids"))

    def _map(self, fn) -> Batch:
        move = lambda t: None if t is None else fn(t)  # noqa: E731
        return type(self)(move(self.tokens), move(self.labels), move(self.positions), move(self.doc_ids))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copies, so the copy to an accelerator can be asynchronous."""
        return self._map(lambda t: t.pin_memory())

    def is_pinned(self) -> bool:
        return self.tokens.is_pinned()

    @property
    def num_targets(self) -> int:
        """Positions that carry a target (the loss's weight of this micro-batch)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for Transformer.forward besides the tokens: positions and document ids (the
        model keeps attention inside documents: suite.models.document_attention)."""
        kwargs = {}
        if self.positions is not None:
            kwargs["positions"] = self.positions
        if self.doc_ids is not None:
            kwargs["doc_ids"] = self.doc_ids
        return kwargs
