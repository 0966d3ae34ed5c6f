"""Tensor (+ sequence) parallelism with DTensor `parallelize_module` plans, Megatron-style.

Per block, for both families (GPT and Llama share module names):

    attention.wq / wk / wv      ColwiseParallel   heads split across tp ranks (the model's
                                                   `.view(b, s, -1, head_dim)` sees local heads)
    attention.wo                RowwiseParallel   partial sums reduced (all-reduce, or
                                                   reduce-scatter along the sequence with sp)
    feed_forward.w1 / w3        ColwiseParallel
    feed_forward.w2             RowwiseParallel

    Fused projections (model.fused_projections): attention.wqkv and feed_forward.w13 are plain
    ColwiseParallel too. Their rows are ordered per kv-head group [q..., k, v] and per (gate, up)
    pair (suite.models.transformer), so the contiguous Shard(0) slice a rank gets holds whole
    groups of q, k and v heads (tp divides num_kv_heads) and whole gate/up pairs: no special plan.

Around the blocks:

    tok_embeddings              RowwiseParallel   vocabulary-parallel embedding: each rank holds
                                                   vocab/tp rows, the lookups are summed
    pos_embeddings (gpt)        Replicated        every rank holds the (small) table; with sp its
                                                   output is cut to this rank's sequence slice
    output                      ColwiseParallel   vocabulary-parallel head; logits stay sharded on
                                                   the vocab dim (a DTensor) for `loss_parallel`, so
                                                   the full [b, s, vocab] logits never exist
    mtp.<k> (DeepSeek-V3)       `mtp_plan`        the multi-token prediction modules: their block as
                                                   a block, norms and projection as the norms

With ``sp`` (sequence parallel) the activations between blocks are sharded along the sequence:
norms run as SequenceParallel on their slice, the attention / MLP inputs are all-gathered
(PrepareModuleInput Shard(1) -> Replicate) and the row-parallel outputs are reduce-scattered back
to Shard(1). Without ``sp`` norms run on the full sequence with Replicate parameters. Either way
every parameter is a DTensor on the tp mesh.

Tied embeddings (gpt): vocabulary-parallel embedding and head both shard the [vocab, hidden]
weight on dim 0 with the same mesh, so after the plans are applied the head is re-tied to the
embedding's DTensor parameter: one parameter, one gradient, one optimizer state, as in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from suite.config.errors import ConfigError
from suite.models.family import family_of
from suite.models.moe import MoEFeedForward
from suite.models.transformer import Attention
from suite.parallel.expert_tensor_parallel import apply_expert_tensor_parallel
from suite.parallel.tp_styles import HeadwiseNorm, LoRAColwise, LoRARowwise, Replicated, SharedAcrossHeads


def _lora_aware(block: nn.Module, plan: dict[str, ParallelStyle], sp: bool) -> dict[str, ParallelStyle]:
    """Swap the linear styles for their LoRA versions where the module carries adapters."""
    out = {}
    for key, style in plan.items():
        module = block.get_submodule(key)
        if hasattr(module, "lora_a"):
            if isinstance(style, ColwiseParallel):
                style = LoRAColwise()
            elif isinstance(style, RowwiseParallel):
                style = LoRARowwise(Shard(1) if sp else Replicate())
        out[key] = style
    return out


def block_plan(sp: bool, cfg, moe: bool = False) -> dict[str, ParallelStyle]:
    """The styles of one block's modules, exactly the modules this model config builds (fused or
    separate projections; SwiGLU's gate and up for Llama): `apply_tensor_parallel` refuses an entry
    that matches nothing, so a plan can never skip a module quietly. An MoE block's plan stops at
    its ffn_norm: suite.parallel.expert_tensor_parallel rewrites the MoE layer."""
    fused, swiglu = cfg.fused_projections, family_of(cfg).swiglu
    if swiglu:
        up = ["feed_forward.w13"] if fused else ["feed_forward.w1", "feed_forward.w3"]
    else:
        up = ["feed_forward.w1"]
    norm: Callable[[], ParallelStyle] = SequenceParallel if sp else Replicated
    plan: dict[str, ParallelStyle] = {"attention_norm": norm()}
    if sp:  # Attention.forward(x, rope, mask, cache): only x is an activation to gather
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        )
    roles: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        "replicate": Replicated,
        "headwise": HeadwiseNorm,
        "shared": SharedAcrossHeads,
    }
    attention = family_of(cfg).attention or Attention  # the module says how it splits
    plan |= {f"attention.{name}": roles[role]() for name, role in attention.tp_roles(cfg).items()}
    plan["ffn_norm"] = norm()
    if moe:
        return plan
    if sp:
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    plan |= {key: ColwiseParallel() for key in up}
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    return plan


def mtp_plan(sp: bool, cfg) -> dict[str, ParallelStyle]:
    """A multi-token prediction module's plan (suite.models.mtp): its dense block split as the
    model's blocks are; its norms and its projection of [hidden; embedding] work per token, so they
    run like the norms (on this rank's sequence slice with sp, their weights' gradients summed over
    the ranks; whole without sp); its input embedding and output head are the model's own
    (vocabulary-parallel)."""
    per_token: Callable[[], ParallelStyle] = (
        (lambda: SequenceParallel(use_local_output=True)) if sp else Replicated
    )
    plan = {name: per_token() for name in ("hidden_norm", "embedding_norm", "projection", "norm")}
    return plan | {f"block.{key}": style for key, style in block_plan(sp, cfg).items()}


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sp: bool, compiled_blocks: bool = False
) -> None:
    """Rewrite `model` (a Transformer or a pipeline part of one) in place for tp = tp_mesh.size().

    Works on any subset of the modules (a pipeline stage may lack embeddings or the head).
    The head's output is a vocab-sharded DTensor: run the loss under `loss_parallel()`.
    compiled_blocks: the blocks will be torch.compile'd (see `_fresh_embedding_output`).
    """
    plans = {
        key: block_plan(sp, model.cfg, isinstance(block.feed_forward, MoEFeedForward))
        for key, block in model.layers.items()
    }
    for key, block in model.layers.items():  # before anything is rewritten
        plan = plans[key]
        missing = [k for k in plan if not _has(block, k)]
        if missing:
            raise RuntimeError(
                f"tensor-parallel plan entries {missing} match no module of layers.{key} "
                f"({type(block).__name__}, family {model.cfg.family}): the plan and the model disagree"
            )
    seq = Shard(1) if sp else Replicate()
    top: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "pos_embeddings", None) is not None:
        top["pos_embeddings"] = Replicated(shard_output_sequence=sp)
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel() if sp else Replicated()
    if hasattr(getattr(model, "output", None), "lora_a"):
        raise ConfigError(
            "finetune.lora.target_modules includes output, which tensor parallelism does not adapt yet; "
            "drop it or use tp=1"
        )
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    if compiled_blocks and "tok_embeddings" in top and "pos_embeddings" not in top:
        model.tok_embeddings.register_forward_hook(_fresh_embedding_output)
    for key, block in model.layers.items():
        parallelize_module(block, tp_mesh, _lora_aware(block, plans[key], sp))
        if isinstance(block.feed_forward, MoEFeedForward):
            apply_expert_tensor_parallel(block.feed_forward, tp_mesh, sp, model.cfg)
    for module in (getattr(model, "mtp", None) or {}).values():
        parallelize_module(module, tp_mesh, mtp_plan(sp, model.cfg))
    retie_embeddings(model)
    _replicate_the_rest(model, tp_mesh)


def _replicate_the_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Modules beside the model's own that no plan names (suite distill's hidden-state projections,
    `distill_proj`) are Replicated, so every parameter is a DTensor on the tp mesh; their inputs
    must be whole on every tp rank (the distillation step gathers the sequence first under sp)."""
    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            parallelize_module(module, tp_mesh, Replicated())


def whole_sequence(x: torch.Tensor, tp_mesh: DeviceMesh, sp: bool) -> torch.Tensor:
    """An activation [b, s, ...] whole on every tp rank, as a plain tensor with its gradient path:
    a DTensor (the final norm's output under sp) is all-gathered, so is a plain sequence slice
    (a block's output under sp); without sp activations between blocks are already whole. The
    gradient arriving here must be the whole one on every rank (the backward keeps this rank's slice)."""
    if isinstance(x, DTensor):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
    if sp:
        return (
            DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
            .redistribute(tp_mesh, [Replicate()])
            .to_local()
        )
    return x


def _fresh_embedding_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """A copy of the vocabulary-parallel embedding's local output, for a compiled first block.

    `DTensor.to_local()` returns a view of the DTensor's local tensor; a compiled block (AOTAutograd)
    that gets such a view as its input hands a plain-tensor gradient to the all-reduce's backward,
    which expects a DTensor (AttributeError: '_local_tensor'; torch 2.13). GPT adds its position
    embeddings first, which makes a fresh tensor; Llama feeds the view straight into block 0.
    The copy is one [b, s, hidden] activation, transient (nothing saves the view).
    """
    return output.clone()


def retie_embeddings(model: nn.Module) -> None:
    """Point the head at the embedding's (now DTensor) weight again when the recipe ties them."""
    if not model.cfg.tie_embeddings:
        return
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if emb is None or out is None:
        return
    if isinstance(emb.weight, DTensor) and isinstance(out.weight, DTensor):
        assert emb.weight.placements == out.weight.placements, (emb.weight.placements, out.weight.placements)
    out.weight = emb.weight


def keep_gradient_layouts(model: nn.Module) -> None:
    """Give each DTensor gradient its parameter's layout as soon as it is accumulated.

    DTensor's embedding backward returns the vocabulary-parallel table's gradient replicated (the
    full [vocab, hidden] on every tp rank); slicing it back to Shard(0) is local and keeps the
    gradient (and the optimizer's view of it) at 1/tp. FSDP2 and `replicate` do this themselves;
    this is for tensor parallelism without a data-parallel wrapper.
    """

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    seen: set[int] = set()
    for param in model.parameters():
        if isinstance(param, DTensor) and id(param) not in seen and param.requires_grad:
            seen.add(id(param))
            param.register_post_accumulate_grad_hook(hook)


def _has(module: nn.Module, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True
