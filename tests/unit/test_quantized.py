"""The quantized checkpoint format (suite.models.quantized): int4 packing and the skip patterns."""

from __future__ import annotations

import torch


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
