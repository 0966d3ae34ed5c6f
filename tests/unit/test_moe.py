"""The MoE layer on its own: router convention, balance and z losses, capacity dropping, dropless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from suite.config.schema import ModelConfig
from suite.models import build_model, materialize
from suite.models.moe import (
    MoEFeedForward,
    expert_mlp,
    grouped_mm_fits,
    moe_aux_loss,
    moe_layer_ids,
    pop_load_stats,
    run_experts,
)

CFG = ModelConfig(
    family="llama",
    num_layers=2,
    hidden_size=16,
    num_heads=2,
    vocab_size=64,
    max_seq_len=32,
    num_experts=4,
    top_k=2,
    moe_ffn_hidden_size=8,
    aux_loss_coef=0.01,
    z_loss_coef=0.001,
)


def _layer(**overrides) -> MoEFeedForward:
    cfg = ModelConfig(**{**vars(CFG), **overrides})
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return layer.train()


def _reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: Mixtral's softmax over all experts, top-k, renormalise, weighted expert sum."""
    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(layer.router(flat).float(), dim=-1)
    top, ids = probs.topk(layer.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    ex = layer.experts
    rows = []
    for t in range(flat.shape[0]):
        rows.append(
            sum(
                top[t, j] * expert_mlp(flat[t : t + 1], ex.w1[e], ex.w2[e], ex.w3[e])[0]
                for j, e in enumerate(ids[t].tolist())
            )
        )
    return torch.stack(rows).view_as(x)


def test_dropless_layer_matches_token_by_token_mixtral_routing():
    layer = _layer()
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)


def test_balance_and_z_losses_follow_their_definitions():
    layer = _layer()
    logits = torch.randn(12, 4)
    ids = logits.topk(2, dim=-1).indices
    balance, z_loss = layer.balance_losses(logits, ids)
    fraction = torch.bincount(ids.flatten(), minlength=4).float() / ids.numel()
    expected = 4 * (fraction * logits.softmax(-1).mean(0)).sum()
    torch.testing.assert_close(balance, expected)
    torch.testing.assert_close(z_loss, torch.logsumexp(logits, -1).pow(2).mean())
    # a uniform router is perfectly balanced in expectation: the loss is exactly 1
    uniform, _ = layer.balance_losses(torch.zeros(8, 4), torch.arange(16).view(8, 2) % 4)
    assert abs(float(uniform) - 1.0) < 1e-6
    # skewed routing costs more, and the weighted sum reaches the router's gradient
    skewed, _ = layer.balance_losses(torch.tensor([[5.0, 0, 0, 0]] * 8), torch.tensor([[0, 1]] * 8))
    assert float(skewed) > 1.5
    layer(torch.randn(1, 6, 16))
    layer.aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0


def test_capacity_drops_late_tokens_and_keeps_first_choices():
    layer = _layer(top_k=1, capacity_factor=0.5)  # capacity ceil(0.5 * 4 tokens * 1 / 4) = 1 per expert
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0  # feature 0 > 0 sends a token to expert 0
    x = torch.zeros(1, 4, 16)
    x[0, :, 0] = 1.0
    x[0, :, 1:] = torch.randn(4, 15)
    out = layer(x)
    ex = layer.experts
    first = expert_mlp(x[0, :1], ex.w1[0], ex.w2[0], ex.w3[0])
    torch.testing.assert_close(out[0, :1], first)
    assert torch.all(out[0, 1:] == 0)  # tokens 1-3 over capacity: dropped, the residual carries them
    assert float(layer.last_stats["dropped"]) == 3
    roomy = _layer(top_k=1, capacity_factor=4.0)  # capacity 4: nothing dropped, same as dropless
    roomy.load_state_dict(layer.state_dict())
    dropless = _layer(top_k=1)
    dropless.load_state_dict(layer.state_dict())
    torch.testing.assert_close(roomy(x), dropless(x))


def test_model_places_moe_layers_and_reports_balance():
    assert moe_layer_ids(ModelConfig(**{**vars(CFG), "num_layers": 4, "moe_every": 2})) == [1, 3]
    assert moe_layer_ids(ModelConfig(**{**vars(CFG), "moe_layers": [0]})) == [0]
    cfg = ModelConfig(**{**vars(CFG), "num_shared_experts": 1})
    model = materialize(build_model(cfg), "cpu", seed=0).train()
    assert model.layers["0"].feed_forward.experts.w1.shape == (4, 8, 16)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    aux = moe_aux_loss(model)
    assert aux is not None and aux.requires_grad
    stats = pop_load_stats(model)
    assert stats["tokens_per_expert"].shape == (2, 4)
    assert float(stats["tokens_per_expert"].sum()) == 2 * 2 * 8 * 2  # layers x tokens x top_k


def _expert_inputs(family: str, hidden: int, width: int, counts: list[int]):
    gen = torch.Generator().manual_seed(1)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, hidden, generator=gen)
    w1, w2 = (
        torch.randn(e, width, hidden, generator=gen) * 0.2,
        torch.randn(e, hidden, width, generator=gen) * 0.2,
    )
    w3 = torch.randn(e, width, hidden, generator=gen) * 0.2 if family == "llama" else None
    return x, torch.tensor(counts), w1, w2, w3, torch.randn(n, hidden, generator=gen)


def _forward_backward(fn, x, counts, w1, w2, w3, grad_out):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3) if t is not None]
    x_, w1_, w2_ = leaves[:3]
    out = fn(x_, counts, w1_, w2_, leaves[3] if w3 is not None else None)
    return [out, *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("hidden", [16, 13])  # 13 * 4 bytes: rows torch._grouped_mm refuses (padded bmm then)
def test_grouped_experts_match_the_loop_forward_and_backward(family, hidden):
    counts = [5, 0, 9, 1, 7]  # an expert without tokens too
    args = _expert_inputs(family, hidden, 8, counts)
    loop = _forward_backward(lambda *a: run_experts(*a, impl="loop"), *args)
    grouped = _forward_backward(lambda *a: run_experts(*a, impl="grouped"), *args)
    padded = _forward_backward(lambda *a: run_experts(*a, impl="padded"), *args)
    assert grouped_mm_fits(args[0], args[2], args[3]) == (hidden == 16)
    for got in (grouped, padded):
        for a, b in zip(got, loop):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unaligned_data_takes_the_padded_path():
    x, counts, w1, w2, w3, grad = _expert_inputs("llama", 16, 8, [3, 4])
    shifted = torch.empty(x.numel() + 1)[1:].view_as(x).copy_(x)  # starts 4 bytes past an aligned address
    assert grouped_mm_fits(x, w1, w2, w3) and not grouped_mm_fits(shifted, w1, w2, w3)
    shifted.requires_grad_()
    x.requires_grad_()
    got, want = (
        run_experts(shifted, counts, w1, w2, w3, "grouped"),
        run_experts(x, counts, w1, w2, w3, "loop"),
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (dx,), (ref,) = torch.autograd.grad(got, [shifted], grad), torch.autograd.grad(want, [x], grad)
    torch.testing.assert_close(dx, ref, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_give_an_empty_result():
    x, _, w1, w2, w3, _ = _expert_inputs("llama", 16, 8, [1, 1])
    for impl in ("grouped", "padded", "loop"):
        assert run_experts(x[:0], torch.zeros(2, dtype=torch.long), w1, w2, w3, impl).shape == (0, 16)


def _train_losses(impl: str, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few SGD steps of a moe-tiny-shaped model on one batch (cross-entropy + balance/z losses)."""
    cfg = ModelConfig(
        **{
            **vars(CFG),
            "num_layers": 2,
            "hidden_size": 32,
            "num_heads": 4,
            "num_kv_heads": 2,
            "num_experts": 8,
            "moe_ffn_hidden_size": 32,
            "moe_impl": impl,
        }
    )
    model = materialize(build_model(cfg), "cpu", seed=0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # AdamW would amplify near-zero gradients' rounding
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + moe_aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_moe_model_trains_the_same_with_grouped_and_looped_experts(impl):
    (loop, loop_params), (fast, fast_params) = _train_losses("loop"), _train_losses(impl)
    assert loop[-1] < loop[0]  # it trains
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(loop), rtol=1e-5, atol=0)
    for name, value in loop_params.items():
        torch.testing.assert_close(fast_params[name], value, rtol=1e-5, atol=1e-6)


def test_moe_impl_is_checked():
    from suite.config.errors import ConfigError
    from suite.models.moe import check_moe_config

    with pytest.raises(ConfigError, match="model.moe_impl='fast'"):
        check_moe_config(ModelConfig(**{**vars(CFG), "moe_impl": "fast"}))


def test_grouped_experts_run_inside_a_compiled_layer():
    """train.compile compiles blocks: torch._grouped_mm's fake kernel takes bf16 only, so the grouped
    matmuls run eagerly between compiled graphs, with the eager layer's output and gradients."""
    layer = _layer()
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(layer)
    got = compiled(x)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    want = layer(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, layer.parameters()):  # inductor fuses the router's softmax differently
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_the_grouped_mm_probe_is_not_fooled_by_no_grad():
    """The probe's answer is cached per process: a first call from evaluation (no_grad,
    inference_mode) must not record that the op cannot run backward."""
    from suite.models.moe import grouped_mm_runs

    cached = grouped_mm_runs.__wrapped__  # under torch.compiler.disable: the functools.cache
    cached.cache_clear()
    with torch.inference_mode():
        assert grouped_mm_runs("cpu", torch.float32)
    cached.cache_clear()
    with torch.no_grad():
        assert grouped_mm_runs("cpu", torch.float32)


def test_pipeline_stage_aux_loss_rides_the_output_backward():
    """An earlier pipeline stage's router losses enter backward through its output: a copy (the
    zero-bubble schedule detaches stage outputs in place, which a view refuses) whose backward also
    gives the aux loss its weight (1 / micro-batches)."""
    from suite.train.pipeline_step import _AttachAux

    x = torch.randn(2, 3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    out = _AttachAux.apply(x, w * 3.0, 0.25)
    assert torch.equal(out, x) and not out._is_view()
    out.detach_()  # what the zero-bubble schedule does to a stage output
    out = _AttachAux.apply(x, w * 3.0, 0.25)
    (out * 2.0).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))
    assert float(w.grad) == 0.75  # d(0.25 * 3w)/dw


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_capacity_ranking_over_cp_chunks_equals_one_process(monkeypatch, cp):
    """suite.parallel.context_parallel_moe.rank_assignments on each of `cp` simulated ranks (the
    all-gather answered with every rank's counts) ranks each assignment exactly where one process's
    choice-major, token-order ranking puts it, and counts the micro-batch's tokens."""
    import torch.distributed as dist

    from suite.parallel.context_parallel import chunk_index
    from suite.parallel.context_parallel_moe import rank_assignments

    rows, seq, k, experts = 3, 12 * cp, 2, 4
    ids = torch.randint(0, experts, (rows, seq, k), generator=torch.Generator().manual_seed(cp))
    order = ids.reshape(-1, k).t().reshape(-1)  # one process: choice-major, then (row, position)
    one_hot = F.one_hot(order, experts)
    expected = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).view(k, rows, seq).permute(1, 2, 0)
    local = [ids[:, chunk_index(seq, cp, r)] for r in range(cp)]

    def counts(local_ids):
        blocks = local_ids.view(rows, 2, -1, k).permute(3, 0, 1, 2)
        return F.one_hot(blocks, experts).sum(3)

    for rank in range(cp):
        monkeypatch.setattr(dist, "get_world_size", lambda group: cp)
        monkeypatch.setattr(dist, "get_rank", lambda group, rank=rank: rank)
        monkeypatch.setattr(
            dist, "all_gather", lambda out, mine, group: [o.copy_(counts(x)) for o, x in zip(out, local)]
        )
        position, tokens = rank_assignments(None, local[rank], experts)
        assert tokens == rows * seq
        assert torch.equal(position, expected[:, chunk_index(seq, cp, rank)]), rank
