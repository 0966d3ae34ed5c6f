"""The quantized checkpoint format (suite.models.quantized): int4 packing and the skip patterns."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_int4_pack_round_trip_and_halves_the_bytes():
    from suite.models.quantized import _pack_int4, _unpack_int4

    values = torch.arange(-8, 8, dtype=torch.int8)
    q = values[torch.randint(0, 16, (6, 64), generator=torch.Generator().manual_seed(0))]
    packed = _pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 32)
    assert torch.equal(_unpack_int4(packed), q)


def test_skip_patterns_match_names_and_subtrees():
    from suite.compress.methods import skipped

    assert skipped("output", ["output"])
    assert skipped("layers.0.attention.wq", ["layers.0"])
    assert skipped("layers.3.feed_forward.w2", ["layers.*.feed_forward.w2"])
    assert not skipped("layers.10.attention.wq", ["layers.1"])
    assert not skipped("layers.0.attention.wq", ["output", "tok_embeddings"])


@pytest.mark.parametrize("method", ["qat-int4", "qat-int8"])
def test_qat_trains_on_the_grid_the_conversion_stores(method):
    """The fake-quantized weight QAT trains with equals the weight of the checkpoint it is converted to
    (suite quantize's int4 / int8), so the converted model computes what training saw."""
    from torchao.quantization import quantize_

    from suite.compress.methods import torchao_config
    from suite.config.schema import CompressConfig
    from suite.models.qat import QAT_METHODS, prepare_qat

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    effective = {}
    for name in ("qat", "converted"):
        model = nn.Sequential(nn.Linear(128, 32, bias=False))
        model[0].weight.data.copy_(weight)
        if name == "qat":
            cfg = CompressConfig(method=method, skip=[], learn_scales=False)
            assert prepare_qat(model, cfg) == ["0"]
        else:
            cfg = CompressConfig(method=QAT_METHODS[method])
            quantize_(model, torchao_config(cfg, torch.device("cpu")))
        with torch.no_grad():
            effective[name] = model(torch.eye(128)).t()
    assert not torch.equal(effective["qat"], weight)  # it does quantize
    assert torch.equal(effective["qat"], effective["converted"])


@pytest.mark.parametrize("method", ["qat-int4", "qat-int8"])
def test_learned_scales_start_at_round_to_nearest_and_the_conversion_stores_them(method):
    """compress.learn_scales: the scales are parameters that start where the per-step computation puts
    them (the same forward as without learning), take gradients, and the conversion rounds on the
    trained values (int8: exactly what training saw; int4: bf16-stored scales, within 2^-8 of it)."""
    from suite.compress.methods import quantize_model, usable_scales
    from suite.config.schema import CompressConfig
    from suite.models.qat import LEARNED_SCALE, QAT_METHODS, init_learned_scales, prepare_qat
    from suite.train.optim import param_groups

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    probe = torch.eye(128)

    def fake_quantized(learn: bool) -> nn.Module:
        model = nn.Sequential(nn.Linear(128, 32, bias=False))
        model[0].weight.data.copy_(weight)
        prepare_qat(model, CompressConfig(method=method, skip=[], learn_scales=learn))
        return model

    fixed, learned = fake_quantized(False), fake_quantized(True)
    assert init_learned_scales(learned, torch.device("cpu")) == 1
    scale = learned[0].weight_fake_quantizer.scale
    groups = 128 // CompressConfig().group_size if method == "qat-int4" else 1
    assert isinstance(scale, nn.Parameter) and tuple(scale.shape) == (32, groups)
    assert [n for n, _ in learned.named_parameters()] == ["0.weight", "0" + LEARNED_SCALE]
    groups = param_groups(learned, 0.1, scale_lr=2.0)
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    assert id(scale) not in decayed and id(learned[0].weight) in decayed
    (ratio,) = [g["lr_ratio"] for g in groups if any(p is scale for p in g["params"])]
    assert ratio == (2.0 if method == "qat-int4" else 2.0 * 7.5 / 127.5)  # the same relative step
    with torch.no_grad():  # the per-step scales' start: the same scales, so the same integers except
        # where w / scale sits on a rounding tie that the reciprocal's precision (bf16 there) decides
        moved = (fixed(probe) != learned(probe)).float().mean().item()
    assert moved < 0.01, moved
    learned(probe).square().sum().backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0  # the scales train
    with torch.no_grad():
        scale.mul_(1 + 0.05 * torch.rand(scale.shape, generator=torch.Generator().manual_seed(1)))
        trained = learned(probe).t()  # what the model trained with the moved scales computes
    plain = nn.Sequential(nn.Linear(128, 32, bias=False))
    plain[0].weight.data.copy_(weight)
    cfg = CompressConfig(method=QAT_METHODS[method], skip=[])
    scales = usable_scales(plain, cfg, {"0": scale.detach().clone()}, method)
    assert set(scales) == {"0"}
    other_grid = CompressConfig(
        method="int4", group_size=64, skip=[]
    )  # not the grid trained: rounded to nearest
    assert usable_scales(plain, other_grid, scales, method) == {}
    assert usable_scales(plain, CompressConfig(method="w8a8", skip=[]), scales, method) == {}
    other = "qat-int8" if method == "qat-int4" else "qat-int4"  # scales a run trained for another grid
    assert usable_scales(plain, cfg, scales, other) == {}
    quantize_model(plain, cfg, torch.device("cpu"), learned_scales=scales)
    with torch.no_grad():
        converted = plain(probe).t()
    rtn = nn.Sequential(nn.Linear(128, 32, bias=False))
    rtn[0].weight.data.copy_(weight)
    quantize_model(rtn, cfg, torch.device("cpu"))
    with torch.no_grad():
        rounded = rtn(probe).t()
    assert not torch.allclose(rounded, trained, rtol=1e-3, atol=0)  # the moved scales make a difference
    if method == "qat-int8":
        assert torch.equal(converted, trained)
    else:
        torch.testing.assert_close(converted, trained, rtol=2**-8, atol=0)


def test_int8_embedding_keeps_the_tie_and_shrinks_the_file(tmp_path):
    """compress.embedding=int8: the tied embedding/head stored once as int8 rows; the reloaded model
    computes what was measured, and the file is smaller than with the float table."""
    from suite.compress.methods import quantize_model
    from suite.config.schema import CompressConfig, ModelConfig
    from suite.models import build_model, materialize
    from suite.models.quantized import load_quantized_model, save_quantized

    cfg = ModelConfig(
        name="t", family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=512,
        max_seq_len=32, tie_embeddings=True,
    )  # fmt: skip
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    sizes, outputs = {}, {}
    for embedding in ("none", "int8"):
        model = materialize(build_model(cfg), "cpu", seed=0).eval()
        with torch.no_grad():
            quantize_model(model, CompressConfig(method="int4", embedding=embedding), torch.device("cpu"))
            outputs[embedding] = after = model(tokens)
        assert model.output.weight is model.tok_embeddings.weight
        quantized = type(model.tok_embeddings.weight).__name__ == "IntxUnpackedToInt8Tensor"
        assert quantized == (embedding == "int8")
        sizes[embedding] = save_quantized(model, tmp_path / embedding, {"method": "int4"}).stat().st_size
        reloaded = load_quantized_model(tmp_path / embedding, cfg)
        assert reloaded.output.weight is reloaded.tok_embeddings.weight
        with torch.no_grad():
            assert torch.equal(reloaded(tokens), after)
    # int8 rows cost little beside int4's own rounding
    assert (outputs["int8"] - outputs["none"]).abs().max() < 0.05 * outputs["none"].abs().max()
    assert sizes["int8"] < sizes["none"] - 2.5 * 512 * 64  # 4 bytes a weight -> 1 (+ a scale per row)
