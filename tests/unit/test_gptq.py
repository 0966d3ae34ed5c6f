"""GPTQ on plain torch (suite.models.gptq): torchao's grid, and less output error than rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from suite.compress.checks import check_compress
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig


def _rtn(weight: torch.Tensor, method: str, grid=None):
    from torchao.quantization import quantize_

    from suite.compress.methods import rtn_config

    layer = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    layer[0].weight.data.copy_(weight)
    quantize_(layer, grid.torchao_config() if grid else rtn_config(method, 32))
    return layer[0].weight


def _grid(method: str, symmetric: bool):
    from suite.compress.methods import grid_for
    from suite.models.gptq import int4_grid

    return int4_grid(32, symmetric) if method == "gptq" else grid_for(method, 32)


GRIDS = [("gptq", True), ("gptq", False), ("gptq-int8", True)]


@pytest.mark.parametrize("method,symmetric", GRIDS)
def test_uncorrelated_inputs_give_torchaos_round_to_nearest(method, symmetric):
    """With H = I nothing is compensated: GPTQ's integers, scales and zero points are torchao's RTN, bit
    for bit, and so is the grid's own round trip (int8_layers' sensitivity)."""
    from suite.models.gptq import gptq_weight

    # rows off-centre, so the asymmetric grid's zero points are not 0
    weight = (
        torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) + torch.linspace(-1, 1, 16)[:, None]
    )
    grid = _grid(method, symmetric)
    q, scales, zeros = gptq_weight(weight, torch.eye(64), grid, damp=0.01)
    rtn = _rtn(weight, method, grid)
    assert torch.equal(q, rtn.qdata)
    assert torch.equal(scales.to(rtn.scale.dtype).reshape(rtn.scale.shape), rtn.scale)
    if hasattr(rtn, "zero_point"):
        assert torch.equal(zeros.reshape(rtn.zero_point.shape), rtn.zero_point)
        assert bool(rtn.zero_point.any()) is not symmetric
        assert torch.equal(grid.round_trip(weight), rtn.dequantize().float())
    else:
        assert not zeros.any()


@pytest.mark.parametrize("method,symmetric", GRIDS)
def test_correlated_inputs_give_less_output_error_than_rounding(method, symmetric):
    from suite.models.gptq import gptq_weight

    gen = torch.Generator().manual_seed(1)
    mix = torch.randn(64, 64, generator=gen)
    x = torch.randn(2048, 8, generator=gen) @ torch.randn(8, 64, generator=gen) + 0.1 * torch.randn(
        2048, 64, generator=gen
    )  # inputs near a low-dimensional subspace, as activations are
    x = x @ mix / 8
    weight = torch.randn(32, 64, generator=gen)
    grid = _grid(method, symmetric)
    q, scales, zeros = gptq_weight(weight, x.t() @ x, grid, damp=0.01)
    group = grid.group or 64
    gptq = (q.float() - zeros.float().repeat_interleave(group, dim=1)) * scales.float().repeat_interleave(
        group, dim=1
    )
    rtn = _rtn(weight, method, grid).dequantize()
    err_gptq = (x @ (weight - gptq).t()).pow(2).sum()
    err_rtn = (x @ (weight - rtn).t()).pow(2).sum()
    assert err_gptq < 0.7 * err_rtn, (float(err_gptq), float(err_rtn))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_whole_model_gets_rtns_tensor_types_and_tracks_the_float_model_better(family):
    from torchao.quantization import quantize_

    from suite.compress.methods import grid_for, linear_plan, rtn_config
    from suite.config.schema import ModelConfig
    from suite.models import build_model, materialize
    from suite.models.gptq import gptq_quantize

    grouped = {"num_kv_heads": 2} if family == "llama" else {}
    cfg = ModelConfig(
        name="t",
        family=family,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        vocab_size=97,
        max_seq_len=32,
        **grouped,
    )
    reference = materialize(build_model(cfg), "cpu", seed=0).eval()
    gen = torch.Generator().manual_seed(2)
    calib = [torch.randint(0, 97, (4, 32), generator=gen) for _ in range(4)]
    held = torch.randint(0, 97, (8, 32), generator=gen)

    def calibrate(m):
        for tokens in calib:
            m(tokens)

    targets, _ = linear_plan(reference, ["tok_embeddings", "pos_embeddings", "output"])
    models = {}
    for name in ("gptq", "rtn"):
        model = materialize(build_model(cfg), "cpu", seed=0).eval()
        with torch.no_grad():
            if name == "gptq":
                gptq_quantize(model, targets, grid_for("gptq", 32), 0.01, calibrate)
            else:
                quantize_(model, rtn_config("gptq", 32), lambda m, n: n in set(targets))
        models[name] = model
    modules = {n: dict(m.named_modules()) for n, m in models.items()}
    for t in targets:
        assert type(modules["gptq"][t].weight) is type(modules["rtn"][t].weight)  # noqa: E721
        assert type(modules["gptq"][t].weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        want = reference(held)
        err = {n: (m(held) - want).pow(2).mean().item() for n, m in models.items()}
    assert err["gptq"] < err["rtn"], err


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize(
    "skip", [["tok_embeddings", "pos_embeddings"], ["layers.0.", "tok_embeddings", "output"]]
)
def test_cached_block_inputs_give_the_same_integers_as_forwards_from_the_embedding(family, skip):
    """GPTQ keeps each block's calibration inputs (one forward per block) instead of re-running the
    model from the embedding for every block: bit-identical integers and scales, with a block left out
    (its inputs still pass through it) and with an untied head (calibrated by a whole forward)."""
    from suite.compress.methods import grid_for, linear_plan
    from suite.config.schema import ModelConfig
    from suite.models import build_model, materialize
    from suite.models.gptq import gptq_quantize

    grouped = {"num_kv_heads": 2} if family == "llama" else {}
    cfg = ModelConfig(
        name="t", family=family, num_layers=3, hidden_size=64, num_heads=4, vocab_size=97, max_seq_len=32,
        tie_embeddings=False, **grouped,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    calib = [torch.randint(0, 97, (2, 32), generator=gen) for _ in range(3)]

    def calibrate(m):
        for tokens in calib:
            m(tokens)

    reference = materialize(build_model(cfg), "cpu", seed=0).eval()
    targets, _ = linear_plan(reference, [s for s in skip if not s.endswith(".")])
    targets = [t for t in targets if not any(t.startswith(s) for s in skip if s.endswith("."))]
    assert any(t.startswith("layers.2.") for t in targets)
    weights = {}
    for cached in (True, False):
        model = materialize(build_model(cfg), "cpu", seed=0).eval()
        gptq_quantize(model, targets, grid_for("gptq", 32), 0.01, calibrate, cache_inputs=cached)
        modules = dict(model.named_modules())
        weights[cached] = {t: (modules[t].weight.qdata, modules[t].weight.scale) for t in targets}
    for t in targets:
        assert torch.equal(weights[True][t][0], weights[False][t][0]), t
        assert torch.equal(weights[True][t][1], weights[False][t][1]), t


@pytest.mark.parametrize("caller", [False, True])
def test_denormals_are_flushed_inside_gptq_only(caller):
    """GPTQ runs with denormal floats flushed (their slow path doubled a real weight's column updates)
    and hands back the caller's own setting, on or off: the switch is thread-global."""
    from suite.compress.methods import grid_for
    from suite.models.gptq import flushing_denormals, gptq_quantize

    model = nn.Sequential(nn.Linear(64, 8, bias=False))
    seen = []

    def calibrate(m):
        seen.append(flushing_denormals())
        m(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))

    torch.set_flush_denormal(caller)
    try:
        gptq_quantize(model, ["0"], grid_for("gptq", 32), 0.01, calibrate)
        assert seen == [True] and flushing_denormals() == caller
    finally:
        torch.set_flush_denormal(False)


def test_the_layer_int4_hurts_most_is_measured_and_kept_at_int8():
    """Mixed precision: sensitivity ranks the Linear whose weight has an outlier in every group (int4's
    scale is set by it, the other weights round to few levels) first; gptq_quantize stores it on the
    int8 grid (the values GPTQ computed for it, as compress=gptq-int8 does) and the rest at int4."""
    from suite.models.gptq import gptq_quantize, int4_grid, sensitivity

    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.randn(64, 64, generator=gen) * 0.05)
        model[1].weight[:, ::32] = 2.0  # one outlier per group of 32
    x = torch.randn(16, 64, generator=gen)

    def calibrate(m):
        m(x)

    grid = int4_grid(32, symmetric=True)  # the symmetric scale spans the outlier both ways
    scores = sensitivity(model, ["0", "1"], grid, calibrate)
    assert scores["1"] > 1.5 * scores["0"] > 0, scores  # measured: 0.0183 against 0.0093
    gptq_quantize(model, ["0", "1"], grid, 0.01, calibrate, int8_layers=["1"])
    assert type(model[0].weight.data).__name__ == "IntxUnpackedToInt8Tensor"
    assert type(model[1].weight.data).__name__ == "Int8Tensor"


def test_int8_layers_on_a_method_that_does_not_read_it_is_refused_in_one_line():
    """Silently ignored, compress.int8_layers=12 with compress=int4 would quantize every layer at int4."""
    cfg = SuiteConfig()
    cfg.compress.method, cfg.compress.int8_layers = "int4", 12
    with pytest.raises(
        ConfigError, match=r"^compress.int8_layers=12 is read by compress=gptq only, not compress=int4"
    ):
        check_compress(cfg, torch.device("cpu"))
    cfg.compress.method = "gptq"
    check_compress(cfg, torch.device("cpu"))  # the method that reads it takes it


def test_clip_search_rounds_no_group_worse_and_some_better():
    """compress.clip_search (gptq's default, with the asymmetric grid): each group takes the shrunk
    range with the least round-trip error, so no group is worse than the full range and a group whose
    range an outlier sets is better (the other weights get finer steps)."""
    from suite.compress.methods import grid_for
    from suite.models.gptq import int4_grid

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 64, generator=gen) * 0.05
    weight[:, ::32] = 0.4  # one outlier per group of 32
    default = grid_for("gptq", 32)
    assert not default.symmetric and default.clip and default == int4_grid(32, False, True)

    def errors(grid):
        return (grid.round_trip(weight) - weight).pow(2).reshape(8, 2, 32).sum(-1)

    plain, clipped = errors(int4_grid(32, False)), errors(default)
    assert (clipped <= plain).all() and (clipped < plain).any(), (clipped, plain)


def _scaled_inputs(seed: int) -> torch.Tensor:
    """Calibration inputs near a low-dimensional subspace whose channels differ in scale by up to
    ~50x, as a real layer's do (a few channels carry most of the activation)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 8, generator=gen) @ torch.randn(8, 64, generator=gen)
    x = x + 0.1 * torch.randn(2048, 64, generator=gen)
    return x * torch.exp(1.3 * torch.randn(64, generator=gen))


def _obs_reference(weight, hessian, grid, damp, order, scales, zeros):
    """Plain GPTQ (the OBS update, one column at a time, no Cholesky factor, no blocks), in float64:
    the columns in `order`, each rounded on the given scale and zero point of its stored group, its
    error spread over the columns not yet rounded through the inverse of their Hessian, recomputed."""
    w, h = weight.double().clone(), hessian.double().clone()
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    q, left = torch.zeros_like(weight), list(order)
    while left:
        j, g = left[0], left[0] // grid.group
        hinv = torch.linalg.inv(h[left][:, left])
        scale, zero = scales[:, g : g + 1], zeros[:, g : g + 1].float()
        qj = grid.quantize(w[:, j : j + 1].float(), scale, zero)
        q[:, j] = qj[:, 0]
        e = (w[:, j] - ((qj - zero) * scale.float())[:, 0].double()) / hinv[0, 0]
        w[:, left] -= e[:, None] * hinv[0][None, :]
        left = left[1:]
    return q


def test_act_order_is_plain_gptq_in_decreasing_diag_h_order_stored_in_the_weights_own_order():
    """compress.act_order: the columns rounded in order of decreasing diag H on each stored group's
    scale and zero point taken from the weight before compensation (static groups) give the integers
    of a plain one-column-at-a-time GPTQ in that order, in the weight's own column order; a layer
    given them computes the dequantized product."""
    from suite.compress.methods import grid_for
    from suite.models.gptq import gptq_quantize, gptq_weight

    x = _scaled_inputs(4)
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    h, grid = x.t() @ x, grid_for("gptq", 32)
    q, scales, zeros = gptq_weight(weight, h, grid, 0.01, act_order=True)
    order = torch.argsort(torch.diag(h), descending=True).tolist()
    assert order != sorted(order)
    static = grid.params(weight.reshape(8, 2, 32), torch.diag(h).reshape(2, 32) if grid.weighted else None)
    assert torch.equal(scales, static[0].reshape(8, 2))
    assert torch.equal(zeros.float(), static[1].reshape(8, 2))
    want = _obs_reference(weight, h, grid, 0.01, order, scales, zeros)
    assert torch.equal(q.float(), want), int((q.float() != want).sum())  # left to right: 157 of 512 differ

    layer = nn.Sequential(nn.Linear(64, 8, bias=False))
    layer[0].weight.data.copy_(weight)
    gptq_quantize(layer, ["0"], grid, 0.01, lambda m: m(x), act_order=True)
    stored = layer[0].weight
    assert torch.equal(stored.qdata, q)
    dequant = (q.float() - zeros.float().repeat_interleave(32, 1)) * scales.float().repeat_interleave(32, 1)
    torch.testing.assert_close(layer(x[:16]), x[:16] @ dequant.t(), rtol=1e-4, atol=1e-4)


def test_act_order_gives_less_output_error_when_input_channels_differ_in_scale():
    from suite.compress.methods import grid_for
    from suite.models.gptq import gptq_weight

    x = _scaled_inputs(6)
    h = x.t() @ x
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))

    def error(act_order: bool) -> float:
        q, scales, zeros = gptq_weight(weight, h, grid_for("gptq", 32), 0.01, act_order=act_order)
        dq = (q.float() - zeros.float().repeat_interleave(32, 1)) * scales.float().repeat_interleave(32, 1)
        delta = weight - dq
        return float(((delta @ h) * delta).sum())

    assert error(True) < 0.5 * error(False), (error(True), error(False))  # measured: 24,736 against 966,424


def test_weighted_clip_search_minimises_the_diag_h_weighted_error_of_each_group():
    """compress.clip_weighted: each group's shrink factor is the one with the least squared error
    weighted by its inputs' diag H (a plain loop over rows, groups and factors here); an outlier whose
    input matters most keeps its range, where the unweighted search clips it. GPTQ passes diag H."""
    from suite.models.gptq import CLIP_SEARCH, gptq_weight, int4_grid

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 64, generator=gen) * 0.05
    weight[:, ::32] = 0.4  # one outlier per group of 32
    importance = torch.ones(64)
    importance[::32] = 200.0  # ... on the input that carries the most
    grid = int4_grid(32, False, True, clip_weighted=True)
    scale, zero = grid.params(weight.reshape(8, 2, 32), importance.reshape(2, 32))
    for r in range(8):
        for g in range(2):
            w, imp = weight[r, g * 32 : (g + 1) * 32], importance[g * 32 : (g + 1) * 32]
            errs = []
            for factor in CLIP_SEARCH:
                s, z = grid._range_params(w[None], factor)
                errs.append(float((imp * ((grid.quantize(w[None], s, z) - z) * s.float() - w).pow(2)).sum()))
            best = min(range(len(errs)), key=lambda i: (errs[i], i))
            s, z = grid._range_params(w[None], CLIP_SEARCH[best])
            assert scale[r, g, 0] == s[0, 0] and zero[r, g, 0] == z[0, 0], (r, g, best)
    plain_scale, _ = grid.params(weight.reshape(8, 2, 32))
    assert (scale >= plain_scale).all() and (scale > plain_scale).any()  # plain: the outlier clipped
    for act_order in (False, True):  # diagonal H: no compensation, GPTQ's scales are the weighted search's
        _, scales, zeros = gptq_weight(weight, torch.diag(importance), grid, 0.01, act_order=act_order)
        assert torch.equal(scales, scale.reshape(8, 2)) and torch.equal(zeros.float(), zero.reshape(8, 2))
