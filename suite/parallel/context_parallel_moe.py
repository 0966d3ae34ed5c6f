"""Context parallelism for Mixture-of-Experts layers: the router's balance loss over the whole sequence.

Routing is per token, so each cp rank routes its own two sequence chunks exactly as one process
would. The Switch balance loss E * sum_e f_e * P_e is not linear in the tokens, though: f (the
fraction of assignments per expert) and P (the mean router probability per expert) must be the
micro-batch's, not a chunk's. Every MoE layer therefore gets `sum_router_stats`: an autograd
all-reduce over the cp group of [probability sums per expert, assignment counts, token count]
(suite.models.moe.MoEFeedForward.balance_losses forms f and P from the sums).

Scaling: every cp rank then holds the same balance loss and adds it with the same weight; the
data-parallel wrapper averages gradients over the cp ranks (divides by cp), and the all-reduce's
backward sums the cp ranks' identical upstream gradients (multiplies by cp), so each rank's
probabilities get exactly one process's gradient. The logged loss (a mean over cp ranks) and the
logged balance loss are one process's too. The z-loss is a per-token mean on each rank: cp ranks
hold equal token counts, so the cp mean of it (what the loss average and gradient average take)
is the whole sequence's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce

from suite.models.moe import MoEFeedForward


def _sum_over(group: dist.ProcessGroup, stats: torch.Tensor) -> torch.Tensor:
    return all_reduce(stats, op=dist.ReduceOp.SUM, group=group)


def apply_context_parallel_moe(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every MoE layer of `model` sum its router statistics over the cp `group` (in place)."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.sum_router_stats = functools.partial(_sum_over, group)
