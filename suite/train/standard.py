"""The components every training run has, whatever its method: model conversions chosen by the
recipe (compress=qat-*: fake quantization; train.precision=fp8: Float8Linear) and, for a
Mixture-of-Experts model, auxiliary-loss-free balancing and the load-balance metrics."""

from __future__ import annotations

import torch

from suite.config.schema import SuiteConfig
from suite.models.float8 import prepare_float8
from suite.models.qat import init_learned_scales, prepare_qat
from suite.parallel.expert_parallel import moe_step_metrics, update_expert_bias
from suite.train.components import Component, Trainer


class ModelConversions(Component):
    """Fake quantization (compress=qat-*) and fp8 matmuls on the meta model before parallelize; the
    learned quantization scales (compress.learn_scales) initialised from the weights finally in place."""

    def adapt_model(self, trainer: Trainer, model: torch.nn.Module) -> None:
        prepare_qat(model, trainer.cfg.compress)
        prepare_float8(model, trainer.precision)  # train.precision=fp8: torchao Float8Linear

    def weights_ready(self, trainer: Trainer) -> None:
        init_learned_scales(trainer.model, trainer.device)


class MoEBalance(Component):
    """An MoE model: the router's expert bias moves after every step (model.router_bias_update_rate,
    every rank), and each logged step adds load balance (and all-to-all bytes) over its window."""

    def after_step(self, trainer: Trainer) -> None:
        if trainer.cfg.model.router_bias_update_rate:
            update_expert_bias(trainer.model, trainer.cfg.model)

    def log_metrics(self, trainer: Trainer, window_steps: int) -> dict:
        return moe_step_metrics(trainer.model, trainer.cfg.model, window_steps, trainer.placement.ep_traffic)


def standard_components(cfg: SuiteConfig) -> list[Component]:
    """What the recipe asks of every method, in the order the hooks run (before the method's own)."""
    return [ModelConversions(), *([MoEBalance()] if cfg.model.num_experts else [])]
