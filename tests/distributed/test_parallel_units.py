"""Fast checks of the pieces the multi-process runs rely on (no processes started)."""

from __future__ import annotations

import torch

from suite.config.schema import ModelConfig
from suite.launch.launcher import _first_failure
from suite.models import build_model, materialize
from suite.parallel.data_parallel import canonical_name, full_init
from suite.train.zero1 import _row_slice


def test_canonical_names_drop_wrapper_segments():
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )
    assert canonical_name("_orig_mod.layers.1.ffn_norm.weight") == "layers.1.ffn_norm.weight"
    assert canonical_name("module.tok_embeddings.weight") == "tok_embeddings.weight"
    assert canonical_name("output.weight") == "output.weight"


def test_row_slices_follow_torch_chunk():
    rows = 5
    pieces = [_row_slice(rows, 4, i) for i in range(4)]
    assert [(o, n) for o, n, _ in pieces] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    expected = [c.shape[0] for c in torch.arange(rows).chunk(4)]
    assert [n for _, n, _ in pieces][: len(expected)] == expected


def test_sharded_init_equals_the_one_process_init():
    """materialize_parallel computes each full parameter with full_init: the plain model's values."""
    for family in ("gpt", "llama"):
        cfg = ModelConfig(
            family=family,
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            vocab_size=64,
            max_seq_len=16,
        )
        model = materialize(build_model(cfg), "cpu", seed=7)
        for name, param in model.named_parameters():
            assert torch.equal(full_init(cfg, name, param.shape, 7), param.detach()), (family, name)


class _Failure:
    def __init__(self, exitcode: int, timestamp: int, message: str = ""):
        self.exitcode, self.timestamp, self.message = exitcode, timestamp, message
        self.error_file_data = {"message": message} if message else {}


class _ChildFailed:
    def __init__(self, failures):
        self.failures = failures


def test_the_blamed_rank_is_the_root_cause():
    # rank 1 was killed (OOM killer); rank 0 then failed on the closed connection; rank 2 got SIGTERM
    failures = {
        0: _Failure(1, 5, "RuntimeError: Connection closed by peer"),
        1: _Failure(-9, 9, "Signal 9 (SIGKILL) received by PID 42"),
        2: _Failure(-15, 1, "Signal 15 (SIGTERM) received by PID 43"),
    }
    assert _first_failure(_ChildFailed(failures))[:2] == (1, -9)
    # rank 3 raised first; the others' errors came after it
    failures = {2: _Failure(1, 8, "RuntimeError: peer"), 3: _Failure(1, 3, "ValueError: bad shard")}
    assert _first_failure(_ChildFailed(failures)) == (3, 1, "ValueError: bad shard")


def test_tensor_parallel_plan_covers_every_block_matrix_and_nothing_else():
    """The plan names exactly the modules each model config builds: every linear layer of a block
    (fused or separate projections, GPT or Llama), no entry that would match nothing."""
    import pytest

    from suite.parallel.tensor_parallel import _has, block_plan

    for family in ("gpt", "llama"):
        for fused in (False, True):
            cfg = ModelConfig(
                family=family,
                num_layers=1,
                hidden_size=64,
                num_heads=4,
                vocab_size=64,
                fused_projections=fused,
            )
            block = build_model(cfg, "meta").layers["0"]
            linears = {n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
            for sp in (False, True):
                plan = block_plan(sp, cfg)
                assert all(_has(block, key) for key in plan), (family, fused, sp, plan.keys())
                assert linears <= plan.keys(), linears - plan.keys()

    # an MoE block: the plan stops at ffn_norm; the MoE layer is rewritten whole (router, experts)
    cfg = ModelConfig(family="llama", num_layers=1, hidden_size=64, num_heads=4, vocab_size=64, num_experts=4)
    block = build_model(cfg, "meta").layers["0"]
    for sp in (False, True):
        plan = block_plan(sp, cfg, moe=True)
        assert all(_has(block, key) for key in plan) and not any("feed_forward" in k for k in plan), plan

    from suite.parallel.tensor_parallel import apply_tensor_parallel

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_heads=4, vocab_size=64)
    model = build_model(cfg, "meta")
    del model.layers["0"].feed_forward.w1  # a model the plan does not describe
    with pytest.raises(RuntimeError, match=r"feed_forward.w1.*match no module of layers.0"):
        apply_tensor_parallel(model, None, sp=False)
