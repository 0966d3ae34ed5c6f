"""Mixture-of-Experts feed-forward: a top-k softmax router in front of stacked experts.

A MoE layer replaces a block's MLP with `num_experts` MLPs of width `moe_ffn_hidden_size`; each
token goes to `top_k` of them, weighted by the softmax over its top-k router logits (Mixtral's
convention: identical to softmax over all experts, top-k, renormalise), plus optional shared experts
that every token uses (one wider MLP, DeepSeek/Qwen-MoE style).

- Expert weights are stacked per layer, `w1`/`w3` [E, ffn, hidden] and `w2` [E, hidden, ffn], so
  expert parallelism shards them on dim 0 (suite.parallel.expert_parallel).
- Load-balancing loss (Switch Transformer): E * sum_e f_e * P_e with f_e the fraction of token
  assignments that expert e receives and P_e its mean router probability; 1.0 when balanced.
  Router z-loss (ST-MoE): mean of logsumexp(logits)^2. Both are weighted by the recipe's
  `model.aux_loss_coef` / `model.z_loss_coef` and left in `aux_loss` for the trainer to add.
- capacity_factor: each expert takes at most ceil(cf * tokens * top_k / E) assignments of a batch;
  first choices are served before second choices, then in token order; the rest are dropped (their
  contribution is zero, the residual connection carries the token). None = dropless. Under context
  parallelism the ranking spans the whole micro-batch (`rank_assignments`, set by suite.parallel).

`GroupedExperts.forward(tokens sorted by expert, count per expert)` is the seam expert
parallelism replaces: it dispatches the sorted tokens to the ranks that own the experts and back.
`GroupedExperts.combine` (token ids and router weights too: copy, experts, weight, sum per token)
is the wider one the hierarchical dispatch replaces, to send each token once per node.
Tokens are sorted by an argsort of their expert ids and scattered back with index_add, and the
experts run as one grouped matmul per weight (`model.moe_impl`, `run_experts`): no per-expert
Python work on the default path, which is what a GPU needs (one kernel per weight, not per expert).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.family import family_of, ffn_size
from suite.models.layers import FeedForward


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    """Which layers are MoE: `model.moe_layers` when given, else every `moe_every`-th (the last of each group)."""
    if cfg.num_experts <= 0:
        return []
    if cfg.moe_layers is not None:
        return sorted(int(i) for i in cfg.moe_layers)
    every = max(1, cfg.moe_every)
    return [i for i in range(cfg.num_layers) if (i + 1) % every == 0]


def expert_ffn_size(cfg: ModelConfig) -> int:
    return cfg.moe_ffn_hidden_size or ffn_size(cfg)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
    """One expert: SwiGLU (w3 = up projection) or tanh-GELU, as the family's MLP."""
    if w3 is not None:
        return F.silu(x @ w1.t()) * (x @ w3.t()) @ w2.t()
    return F.gelu(x @ w1.t(), approximate="tanh") @ w2.t()


MOE_IMPLS = ("grouped", "padded", "loop")  # model.moe_impl


@dataclasses.dataclass(frozen=True)
class ExpertAdapter:
    """A LoRA update of one stacked weight (suite.models.lora adds them): expert e's projection of
    rows x is x W[e]^T + (dropout(x) A[e]^T) B[e]^T * scaling, A [E, rank, in], B [E, out, rank]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: Callable[[torch.Tensor], torch.Tensor]


Adapters = dict[str, ExpertAdapter]  # by weight name: "w1", "w2", "w3"


def _mlp(proj: Callable[[str, torch.Tensor], torch.Tensor], x: torch.Tensor, gated: bool) -> torch.Tensor:
    """The expert MLP over a projection `proj(weight name, input)`: SwiGLU or tanh-GELU."""
    if gated:
        return proj("w2", F.silu(proj("w1", x)) * proj("w3", x))
    return proj("w2", F.gelu(proj("w1", x), approximate="tanh"))


def _loop_experts(
    x: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """One matmul chain per expert (the reference `model.moe_impl=loop` keeps)."""
    weights, adapters = {"w1": w1, "w2": w2, "w3": w3}, adapters or {}
    outputs = []
    for e, rows in enumerate(x.split(counts)):
        if not rows.shape[0]:
            continue

        def proj(name: str, h: torch.Tensor, e: int = e) -> torch.Tensor:
            out = h @ weights[name][e].t()
            ad = adapters.get(name)
            if ad is not None:
                out = out + (ad.dropout(h) @ ad.a[e].t()) @ ad.b[e].t() * ad.scaling
            return out

        outputs.append(_mlp(proj, rows, w3 is not None))
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


@torch.compiler.disable
@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward here (a private op: CPU fp32/bf16/fp16 in
    torch 2.13, while some CUDA builds take bf16 on sm90+ only); probed once per device type and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # with grad on: a first call from inside no_grad/inference_mode (eval) must not cache False
        with torch.inference_mode(False), torch.enable_grad():
            return _probe_grouped_mm(device_type, dtype)
    except (RuntimeError, NotImplementedError, TypeError):  # the op refuses this device or dtype
        return False


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """A tiny forward and backward of torch._grouped_mm; raises where it does not run."""
    a = torch.ones(4, 8, device=device_type, dtype=dtype, requires_grad=True)
    b = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
    out = torch._grouped_mm(
        a, b.transpose(-2, -1), offs=torch.tensor([1, 4], device=device_type, dtype=torch.int32)
    )
    torch.autograd.grad(out, (a, b), torch.ones_like(out))
    return True


@torch.compiler.disable  # reads data pointers: eager in a compiled block
def grouped_mm_fits(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None = None,
    adapters: Adapters | None = None,
) -> bool:
    """torch._grouped_mm wants 16-byte aligned rows and data (hidden and ffn widths in elements:
    multiples of 4 in fp32, 8 in bf16; weights that are views into a flat buffer, as FSDP's
    unsharded parameters are, may start anywhere; a LoRA rank likewise) and a dtype it runs on
    this device."""
    size = x.element_size()
    ads = list((adapters or {}).values())
    widths = [w1.shape[2], w1.shape[1], *(ad.a.shape[1] for ad in ads)]
    aligned = all((n * size) % 16 == 0 for n in widths)
    tensors = [x, w1, w2, w3, *(t for ad in ads for t in (ad.a, ad.b))]
    starts = all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)
    same = all(t.dtype == x.dtype for t in tensors if t is not None)
    return aligned and starts and same and grouped_mm_runs(x.device.type, x.dtype)


@torch.compiler.disable  # torch 2.13's fake-tensor kernel of _grouped_mm takes bf16 only: eager in a compiled block
def _grouped_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """Every expert in one torch._grouped_mm per weight (and per LoRA factor): the rows of expert e
    are offs[e-1]:offs[e]."""
    offs = counts.cumsum(0).to(torch.int32)
    weights, adapters = {"w1": w1, "w2": w2, "w3": w3}, adapters or {}

    def proj(name: str, h: torch.Tensor) -> torch.Tensor:
        out = torch._grouped_mm(h, weights[name].transpose(-2, -1), offs=offs)
        ad = adapters.get(name)
        if ad is not None:
            low = torch._grouped_mm(ad.dropout(h).contiguous(), ad.a.transpose(-2, -1), offs=offs)
            out = out + torch._grouped_mm(low, ad.b.transpose(-2, -1), offs=offs) * ad.scaling
        return out

    return _Contiguous.apply(_mlp(proj, x.contiguous(), w3 is not None))


class _Contiguous(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward refuses
    stride-0 gradients (what `.sum()` sends back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _padded_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """The fallback where torch._grouped_mm does not run: rows scattered into an [E, max count, h]
    buffer (zeros elsewhere), one batched matmul per weight, the real rows gathered back."""
    num_experts = counts.shape[0]
    if x.shape[0] == 0:
        return x.new_zeros(0, w2.shape[1])
    expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts)
    starts = counts.cumsum(0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(num_experts, int(counts.max()), x.shape[1]).index_put((expert, slot), x)
    weights, adapters = {"w1": w1, "w2": w2, "w3": w3}, adapters or {}

    def proj(name: str, h: torch.Tensor) -> torch.Tensor:
        out = torch.bmm(h, weights[name].transpose(-2, -1))
        ad = adapters.get(name)
        if ad is not None:  # padding rows are zeros: their low-rank term is zero too
            low = torch.bmm(ad.dropout(h), ad.a.transpose(-2, -1))
            out = out + torch.bmm(low, ad.b.transpose(-2, -1)) * ad.scaling
        return out

    return _mlp(proj, padded, w3 is not None)[expert, slot]


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    impl: str = "grouped",
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """Rows of `x` grouped by expert (counts[e] rows for expert e of the given weights), each through its MLP.

    impl="grouped" (model.moe_impl): one grouped matmul per weight for all experts, no per-expert
    Python work (the padded batched matmul where torch._grouped_mm does not run); "padded": always
    the padded batched matmul; "loop": one matmul chain per expert, the reference. `adapters`:
    LoRA updates of some of the weights, computed low-rank beside them in the same way.
    """
    if impl == "loop":
        return _loop_experts(x, counts.tolist(), w1, w2, w3, adapters)
    if impl == "grouped" and grouped_mm_fits(x, w1, w2, w3, adapters):
        return _grouped_experts(x, counts, w1, w2, w3, adapters)
    return _padded_experts(x, counts, w1, w2, w3, adapters)


class GroupedExperts(nn.Module):
    """E experts with stacked weights; forward takes tokens already sorted by expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width, hidden, experts = expert_ffn_size(cfg), cfg.hidden_size, cfg.num_experts
        self.w1 = nn.Parameter(torch.empty(experts, width, hidden))  # gate (llama) / fc (gpt)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, width))  # down / proj
        self.w3 = nn.Parameter(torch.empty(experts, width, hidden)) if family_of(cfg).swiglu else None  # up
        self.impl = cfg.moe_impl
        # LoRA (suite.models.lora.apply_lora adds them; absent otherwise): per-expert factors
        # lora_a[name] [E, rank, in] and lora_b[name] [E, out, rank] (nn.ParameterDict), stacked like
        # the weights so expert parallelism shards them too, lora_scaling and lora_dropout

    def adapters(self, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Adapters | None:
        """The LoRA updates by weight name (None without LoRA); `local` maps a factor to this rank's part."""
        lora_a, lora_b = getattr(self, "lora_a", None), getattr(self, "lora_b", None)
        if lora_a is None or lora_b is None or getattr(self, "lora_off", False):  # lora.adapters_disabled
            return None
        return {
            name: ExpertAdapter(local(a), local(lora_b[name]), self.lora_scaling, self.lora_dropout)
            for name, a in lora_a.items()
        }

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_experts(x, counts, self.w1, self.w2, self.w3, self.impl, self.adapters())

    def combine(
        self, flat: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The routed output [T, h] of tokens `flat` [T, h]: each kept assignment (sorted by expert:
        its token id in `tokens`, its router weight in `weights`; `counts` per expert) through its
        expert, weighted, summed per token. Token ids are part of the seam so that a dispatch that
        sends each token once per node (suite.parallel.hierarchical_dispatch) can replace it whole."""
        routed = self(flat[tokens], counts)
        routed = routed * weights[:, None].to(routed.dtype)
        return torch.zeros_like(flat).index_add_(0, tokens, routed.to(flat.dtype))


class MoEFeedForward(nn.Module):
    """Router + experts (+ shared experts). Drop-in for FeedForward: [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.z_loss_coef = cfg.z_loss_coef
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.sigmoid = cfg.router_score == "sigmoid"
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.routed_scaling_factor = cfg.routed_scaling_factor
        if self.sigmoid:  # added to the scores for choosing experts only (aux-loss-free balancing)
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.load_since_update: torch.Tensor | None = (
            None  # assignments per expert since the last bias update
        )
        self.experts = GroupedExperts(cfg)
        self.shared_experts = None
        if cfg.num_shared_experts:
            width = cfg.num_shared_experts * expert_ffn_size(cfg)
            self.shared_experts = FeedForward(dataclasses.replace(cfg, ffn_hidden_size=width))
        self.aux_loss: torch.Tensor | None = None  # weighted aux + z loss of the last forward
        # sums a rank's router statistics over the ranks sharing its micro-batch's tokens (an
        # autograd sum; suite.parallel.context_parallel_moe sets it under context parallelism)
        self.sum_router_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        # capacity dropping where the micro-batch's tokens are spread over ranks (context parallelism,
        # set by suite.parallel.context_parallel_moe): (expert ids [rows, tokens, k], experts) ->
        # (each assignment's rank within its expert in the micro-batch's choice-major, token order,
        # [rows, tokens, k]; the micro-batch's token count), so the same assignments drop as in one process
        self.rank_assignments: Callable[[torch.Tensor, int], tuple[torch.Tensor, int]] | None = None
        self.stats: dict[str, torch.Tensor] = {}  # detached sums since the last `pop_stats`
        self.last_stats: dict[str, torch.Tensor] = {}
        # every expert on every token, weighted by the router (zero where a token did not choose it):
        # the same output with no data-dependent shape, what torch.export and the ONNX exporter
        # trace (suite.infer.graphs.traceable_moe sets it); num_experts / top_k times the expert work
        self.dense = False

    def reset_buffers(self) -> None:
        """The balancing bias starts at zero (a materialised meta model holds uninitialised memory)."""
        if self.sigmoid:
            self.expert_bias.zero_()

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def route(self, logits: torch.Tensor, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k], keep mask [T, k]) for router logits [T, E] in fp32 of
        `rows` sequences' tokens (row-major)."""
        expert_ids, weights = self.choose(logits)
        if self.capacity_factor is None:
            return expert_ids, weights, torch.ones_like(expert_ids, dtype=torch.bool)
        if self.rank_assignments is not None:  # the micro-batch's tokens are spread over ranks
            position, tokens = self.rank_assignments(expert_ids.view(rows, -1, self.top_k), self.num_experts)
            return expert_ids, weights, position.view_as(expert_ids) < self.capacity(tokens)
        # choice-major order (every token's first choice before any second choice), then token order
        order = expert_ids.t().reshape(-1)
        one_hot = F.one_hot(order, self.num_experts)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)  # rank of each assignment within its expert
        keep = (position < self.capacity(logits.shape[0])).view(self.top_k, -1).t()
        return expert_ids, weights, keep

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k]) from router logits [T, E] in fp32.

        softmax: the top-k logits, their weights the softmax over all experts taken at the top k,
        renormalised to sum to 1 with model.norm_topk_prob (Mixtral's convention: the softmax over the
        top-k logits). sigmoid (DeepSeek-V3): each expert's score is its own sigmoid; the choice adds
        `expert_bias` and keeps the `router_topk_groups` best groups (by their two best scores), the
        weights are the unbiased scores; then routed_scaling_factor."""
        if not self.sigmoid:
            top_logits, expert_ids = logits.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:  # softmax over the top k = softmax over all, renormalised
                weights = top_logits.softmax(dim=-1)
            else:
                weights = logits.softmax(dim=-1).gather(-1, expert_ids)
            return (
                expert_ids,
                weights if self.routed_scaling_factor == 1.0 else weights * self.routed_scaling_factor,
            )
        scores = logits.sigmoid()
        biased = scores + self.expert_bias
        if self.groups > 1:
            grouped = biased.view(-1, self.groups, self.num_experts // self.groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            biased = biased.masked_fill(
                ~mask.repeat_interleave(self.num_experts // self.groups, dim=1), float("-inf")
            )
        expert_ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor

    def balance_losses(
        self, logits: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Switch load-balancing loss, router z-loss), both unweighted.

        The balance loss is not linear in the tokens: where the micro-batch's tokens are spread over
        several ranks (context parallelism), `sum_router_stats` (set by suite.parallel, absent
        otherwise) sums the per-expert probability sums (with gradient), assignment counts and token
        count over them first, so f and P are the whole micro-batch's. The z-loss stays this rank's
        per-token mean (a mean of equal-sized parts' means is the whole mean)."""
        probs = logits.softmax(dim=-1)
        if self.sigmoid:  # DeepSeek-V3's balance loss: each token's scores normalised to sum to 1
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).to(probs.dtype)
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        if self.sum_router_stats is None:
            fraction = counts / expert_ids.numel()
            return self.num_experts * (fraction * probs.mean(0)).sum(), z_loss
        e = self.num_experts
        sums = self.sum_router_stats(
            torch.cat([probs.sum(0), counts, probs.new_tensor([float(logits.shape[0])])])
        )
        prob_sums, counts, tokens = sums[:e], sums[e : 2 * e], sums[2 * e]
        balance = e * (counts / (tokens * expert_ids.shape[-1]) * (prob_sums / tokens)).sum()
        return balance, z_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat).float()
        expert_ids, weights, keep = self.route(logits, rows=shape[0] if x.dim() == 3 else 1)
        if self.dense:
            return self._dense_forward(flat, expert_ids, weights * keep).view(shape)
        balance, z_loss = self.balance_losses(logits, expert_ids)
        self.aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z_loss

        # the kept assignments, sorted by expert (stable: token order within an expert)
        token_ids = torch.arange(flat.shape[0], device=x.device)[:, None].expand_as(expert_ids)
        kept_experts, kept_tokens, kept_weights = expert_ids[keep], token_ids[keep], weights[keep]
        order = torch.argsort(kept_experts, stable=True)
        counts = torch.bincount(kept_experts, minlength=self.num_experts)
        out = self.experts.combine(flat, kept_tokens[order], kept_weights[order], counts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        self._note(counts, balance, z_loss, expert_ids.numel() - int(counts.sum()))
        return out.view(shape)

    def _dense_forward(
        self, flat: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward`'s output for inference with every expert run on every token ([T, h] -> [T, h]):
        the router weights scattered into [T, E] (zero for experts a token did not choose or that
        capacity dropped) weigh the experts' outputs; no aux loss, no statistics."""
        if self.experts.adapters() is not None:
            raise RuntimeError(
                "the dense MoE forward (graph export) runs without LoRA adapters: merge them first"
            )
        gate = weights.new_zeros(flat.shape[0], self.num_experts).scatter_add_(1, expert_ids, weights)
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3
        up = torch.einsum("th,efh->etf", flat, w1)
        act = (
            F.silu(up) * torch.einsum("th,efh->etf", flat, w3)
            if w3 is not None
            else F.gelu(up, approximate="tanh")
        )
        routed = torch.einsum("etf,ehf->eth", act, w2)
        out = torch.einsum("te,eth->th", gate.to(routed.dtype), routed).to(flat.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        self.aux_loss = None
        return out

    @torch.no_grad()
    def _note(self, counts: torch.Tensor, balance: torch.Tensor, z_loss: torch.Tensor, dropped: int) -> None:
        if not self.training:
            return
        new = {
            "tokens_per_expert": counts.detach().double(),
            "balance_loss": balance.detach().double(),
            "z_loss": z_loss.detach().double(),
            "dropped": torch.tensor(float(dropped), dtype=torch.float64),
            "calls": torch.tensor(1.0, dtype=torch.float64),
        }
        self.last_stats = {key: value.cpu() for key, value in new.items()}

    def commit_stats(self) -> None:
        """Add the last forward's figures to the running sums (once per micro-batch: a recomputed
        forward in the backward pass overwrites `last_stats` but is never committed)."""
        for key, value in self.last_stats.items():
            self.stats[key] = self.stats[key] + value if key in self.stats else value
        if "tokens_per_expert" in self.last_stats and self.sigmoid:
            load = self.last_stats["tokens_per_expert"]
            self.load_since_update = load if self.load_since_update is None else self.load_since_update + load
        self.last_stats = {}

    def pop_stats(self) -> dict[str, torch.Tensor]:
        stats, self.stats = self.stats, {}
        return stats


def moe_modules(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the weighted auxiliary losses of the last forward's MoE layers (None for dense models).

    Call once per training micro-batch, after its forward: it also commits the load statistics.
    """
    modules = moe_modules(model)
    for module in modules:
        module.commit_stats()
    losses = [m.aux_loss for m in modules if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def pop_load_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """Sums since the last call over this rank's MoE layers: token counts per layer [L, E] and scalars."""
    popped = [m.pop_stats() for m in moe_modules(model)]
    popped = [s for s in popped if s]
    if not popped:
        return {}
    return {
        "tokens_per_expert": torch.stack([s["tokens_per_expert"] for s in popped]),
        **{k: sum(s[k] for s in popped) for k in ("balance_loss", "z_loss", "dropped", "calls")},
    }


def load_metrics(stats: dict[str, torch.Tensor], top_k: int) -> dict[str, float]:
    """Loggable figures from (all-reduced) stats: worst layer's max/mean tokens per expert, etc."""
    counts = stats["tokens_per_expert"]
    per_layer = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
    calls = float(stats["calls"])
    assigned = float(counts.sum() + stats["dropped"])
    return {
        "moe_load_max_over_mean": float(per_layer.max()),
        "moe_balance_loss": float(stats["balance_loss"]) / calls,
        "moe_z_loss": float(stats["z_loss"]) / calls,
        "moe_dropped_frac": float(stats["dropped"]) / max(assigned, 1.0),
    }


def check_moe_config(cfg: ModelConfig) -> None:
    """One-line ConfigErrors for impossible MoE settings (called by suite.models.checks)."""
    e = cfg.num_experts
    if not 1 <= cfg.top_k <= e:
        raise ConfigError(
            f"model.top_k={cfg.top_k} must be between 1 and model.num_experts={e}; use e.g. model.top_k={min(2, e)}"
        )
    if cfg.moe_every < 1:
        raise ConfigError(f"model.moe_every={cfg.moe_every} must be >= 1 (1: every layer is MoE)")
    if cfg.moe_layers is not None:
        bad = [i for i in cfg.moe_layers if not 0 <= int(i) < cfg.num_layers]
        if bad:
            raise ConfigError(
                f"model.moe_layers={list(cfg.moe_layers)} names layer {bad[0]}, which is not in "
                f"[0, model.num_layers={cfg.num_layers}); list layer ids from 0 to {cfg.num_layers - 1}"
            )
    if not moe_layer_ids(cfg):
        raise ConfigError(
            f"model.num_experts={e} but no layer is MoE (model.moe_every={cfg.moe_every} > model.num_layers="
            f"{cfg.num_layers}); lower moe_every or list model.moe_layers"
        )
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        raise ConfigError(
            f"model.capacity_factor={cfg.capacity_factor} must be positive (e.g. 1.25), or null for dropless"
        )
    for key in ("num_shared_experts", "aux_loss_coef", "z_loss_coef"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 0")
    if cfg.moe_impl not in MOE_IMPLS:
        raise ConfigError(
            f"model.moe_impl={cfg.moe_impl!r} is not one of {', '.join(MOE_IMPLS)}; use model.moe_impl=grouped"
        )
    if cfg.moe_ffn_hidden_size is not None and cfg.moe_ffn_hidden_size < 1:
        raise ConfigError(f"model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} must be a positive integer")
