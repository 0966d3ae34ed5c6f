"""Every layout trains like one process: same per-step losses, same final weights (fp32, gloo).

Reference: the single-process run with the same seed, data and global batch (16 sequences, as 4
micro-batches of 4). Each layout is the real CLI with launch.nproc_per_node=N; its final
checkpoint is loaded into a plain model whatever layout wrote it (DCP).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import reference_name
from tests.helpers import assert_close_losses, assert_close_weights, final_weights, train_losses

# loading a checkpoint into a plain model in this (non-distributed) test process is the intent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The attention key bias gets no gradient in exact arithmetic (softmax ignores a shift that is the
# same for every key of a query); in floating point it gets rounding noise, which AdamW turns into
# ~1e-7 updates whose sign depends on summation order. Compared in absolute terms instead.
NOISE_ONLY = ("attention.wk.bias",)


def assert_layout_weights(ref: dict, got: dict, tol: float = 1e-4, noise_atol: float = 1e-5) -> None:
    noise = [k for k in ref if k.endswith(NOISE_ONLY)]
    for name in noise:
        assert float((ref[name] - got[name]).abs().max()) <= noise_atol, name
    assert_close_weights(
        {k: v for k, v in ref.items() if k not in noise},
        {k: v for k, v in got.items() if k not in noise},
        tol,
    )


def check_layout(layout_run, name: str) -> None:
    ref_dir, run_dir = layout_run(reference_name(name)), layout_run(name)
    ref_losses, losses = train_losses(ref_dir), train_losses(run_dir)
    assert len(ref_losses) == 10
    assert_close_losses(ref_losses, losses, rtol=1e-4)
    assert_layout_weights(final_weights(ref_dir), final_weights(run_dir))


@pytest.mark.parametrize(
    "name",
    [
        "dp2",
        "sharding2-stage1",
        "sharding2-stage2",
        "sharding2-stage3",
        "sharding2-stage3-prefetch",
        "sharding2-offload",
        "sharding2-stage3-chunked-loss",
        "tp2",
        "tp2-sp",
        "llama-tp2",
        "llama-tp2-sp",
        "llama-tp2-fused",
    ],
)
def test_two_process_layout_matches_single_process(layout_run, name):
    check_layout(layout_run, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2-tp2", "sharding2-tp2", "hsdp"])
def test_four_process_layout_matches_single_process(layout_run, name):
    check_layout(layout_run, name)


def test_logged_metrics_come_from_rank_zero_only(layout_run):
    """One metrics.jsonl line per logged step (not one per rank), with the global-batch loss."""
    from tests.helpers import read_metrics

    records = read_metrics(layout_run("dp2"))
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 11))
