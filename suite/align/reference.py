"""The reference model of an alignment method: the base model's per-token log-probabilities, frozen.

Two kinds, one interface (`token_logps(tokens, kwargs) -> [b, s]` fp32 log-probabilities of each
position's next input token, no gradient; suite.align.logps):

    FrozenReference       full finetuning: a second model loaded from model.init_from and placed like
                          the policy by the same `parallelize` (suite.frozen_model, as distillation's
                          teacher): sharded under FSDP, never trained
    AdapterOffReference   align.lora=true: the policy itself with its LoRA adapters switched off
                          (suite.models.lora.adapters_disabled); the base weights are frozen under LoRA,
                          so this is exactly the base, and no second copy of its weights exists

Both run in eval mode (no dropout), inside the step's autocast.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from suite.align.logps import next_token_logps
from suite.frozen_model import FrozenModel, load_frozen
from suite.model_source import ModelSource
from suite.models.lora import adapters_disabled
from suite.train.components import Trainer


class Reference(Protocol):
    """What an alignment method asks of its reference model."""

    def token_logps(self, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """[b, s] fp32 log p(tokens[:, t + 1] | tokens[:, :t + 1]); 0 at the last position."""
        ...


def _logps(model: nn.Module, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return model(tokens, head=lambda hidden, weight: next_token_logps(hidden, weight, tokens), **kwargs)


class FrozenReference:
    """A frozen copy of the base model, placed like the policy."""

    def __init__(self, frozen: FrozenModel):
        self.frozen = frozen
        self.model = frozen.model

    @torch.no_grad()
    def token_logps(self, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return _logps(self.model, tokens, kwargs)


class AdapterOffReference:
    """The LoRA policy with its adapters off: the base model without a copy of it."""

    def __init__(self, policy: nn.Module):
        self.model = policy

    @torch.no_grad()
    def token_logps(self, tokens: torch.Tensor, kwargs: dict) -> torch.Tensor:
        training = self.model.training
        self.model.eval()  # no dropout in the reference
        try:
            with adapters_disabled(self.model):
                return _logps(self.model, tokens, kwargs)
        finally:
            self.model.train(training)


def load_reference(trainer: Trainer) -> Reference:
    """The run's reference: the policy with adapters off under align.lora, else model.init_from
    loaded a second time, frozen and placed like the policy."""
    cfg = trainer.cfg
    if cfg.align.lora:
        return AdapterOffReference(trainer.model)
    source = ModelSource.parse(cfg.model.init_from, "model.init_from")
    frozen = load_frozen(cfg, trainer.dims, trainer.device, trainer.precision, source, "model.init_from")
    return FrozenReference(frozen)
