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

Capacity dropping (`model.capacity_factor`) ranks a micro-batch's assignments per expert, every
token's first choice before any second choice, then in token order, and drops those past the
capacity ceil(cf * tokens * k / E). Under cp the micro-batch's tokens sit on cp ranks in
load-balanced chunks, so every MoE layer also gets `rank_assignments`: each rank counts its
assignments per (choice, row, chunk, expert), all-gathers the counts over the cp group, and ranks
its own assignments after everything that precedes them in the micro-batch's order; the capacity
is the whole micro-batch's. The same assignments drop as in one process (Megatron-Core instead
sizes capacity per rank, which drops differently from one process).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce

from suite.models.moe import MoEFeedForward


def _sum_over(group: dist.ProcessGroup, stats: torch.Tensor) -> torch.Tensor:
    return all_reduce(stats, op=dist.ReduceOp.SUM, group=group)


@torch.no_grad()
def rank_assignments(
    group: dist.ProcessGroup, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, int]:
    """(rank of each assignment within its expert in the micro-batch, micro-batch token count) for
    this cp rank's expert ids [rows, 2L, k] (chunk r, then chunk 2cp-1-r of every row)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, local, k = expert_ids.shape
    blocks = expert_ids.view(rows, 2, local // 2, k).permute(3, 0, 1, 2)  # [k, rows, 2 chunks, L]
    one_hot = F.one_hot(blocks, num_experts)  # [k, rows, 2, L, E]
    counts = one_hot.sum(3)  # [k, rows, 2, E]
    gathered = [torch.empty_like(counts) for _ in range(cp)]
    dist.all_gather(gathered, counts.contiguous(), group=group)
    every = torch.stack(gathered)  # [cp, k, rows, 2, E]; rank j holds chunks j and 2cp-1-j
    by_chunk = torch.cat([every[:, :, :, 0], every[:, :, :, 1].flip(0)])  # [2cp, k, rows, E]
    ordered = by_chunk.permute(1, 2, 0, 3).reshape(-1, num_experts)  # choice, row, chunk order
    before = (ordered.cumsum(0) - ordered).view(k, rows, 2 * cp, num_experts)
    mine = before[:, :, [rank, 2 * cp - 1 - rank]]  # [k, rows, 2, E]
    within = one_hot.cumsum(3) - one_hot  # assignments to the same expert earlier in the chunk
    position = ((within + mine[:, :, :, None]) * one_hot).sum(-1)  # [k, rows, 2, L]
    return position.permute(1, 2, 3, 0).reshape(rows, local, k), rows * local * cp


def apply_context_parallel_moe(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every MoE layer of `model` sum its router statistics over the cp `group` and rank its
    assignments for capacity over the whole micro-batch (in place)."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.sum_router_stats = functools.partial(_sum_over, group)
            module.rank_assignments = functools.partial(rank_assignments, group)
