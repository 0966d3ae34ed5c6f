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
            assert prepare_qat(model, CompressConfig(method=method, skip=[])) == ["0"]
        else:
            cfg = CompressConfig(method=QAT_METHODS[method])
            quantize_(model, torchao_config(cfg, torch.device("cpu")))
        with torch.no_grad():
            effective[name] = model(torch.eye(128)).t()
    assert not torch.equal(effective["qat"], weight)  # it does quantize
    assert torch.equal(effective["qat"], effective["converted"])
