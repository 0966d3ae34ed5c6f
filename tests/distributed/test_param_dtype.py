"""train.param_dtype=bf16 through the real CLI: one process (bf16 parameters, the optimizer's fp32
masters) and FSDP2 sharding (its MixedPrecisionPolicy keeps the fp32 shards) train alike, and both
checkpoints hold fp32 weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from suite.train.checkpoint import resolve_checkpoint
from tests.helpers import assert_close_losses, final_weights, train_losses

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("name", ["single-bf16-params", "sharding2-bf16-params"])
def test_checkpoint_weights_are_fp32(layout_run, name):
    meta = dcp.FileSystemReader(str(resolve_checkpoint(layout_run(name)))).read_metadata()
    dtypes = {m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert dtypes == {torch.float32}


def test_sharded_bf16_params_train_like_one_process(layout_run):
    ref, got = layout_run("single-bf16-params"), layout_run("sharding2-bf16-params")
    ref_losses = train_losses(ref)
    assert len(ref_losses) == 10 and ref_losses[10] < ref_losses[1]
    assert_close_losses(ref_losses, train_losses(got), rtol=1e-2)  # bf16 compute: summation order differs
    ref_weights, weights = final_weights(ref), final_weights(got)
    for key, value in ref_weights.items():
        assert float((value - weights[key]).abs().max()) < 5e-3, key
