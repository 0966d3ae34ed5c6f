"""The planner under optim=muon (suite.plan.muon_cost): Muon's state, its Newton-Schulz work and its
gather/scatter, against the model's own tensors, torch's FLOP counter and the bytes the trainer
reports (docs/training.md: summary.json `muon_per_step`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from suite.config.cluster import ClusterConfig
from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.models.transformer import Transformer
from suite.plan import comm
from suite.plan.layout import Job, Layout, MuonJob, check_layout
from suite.plan.memory import state_bytes
from suite.plan.muon_cost import muon_time, newton_schulz_flops
from suite.train.muon import newton_schulz

# the distributed layout test's model: 2 layers, width 64 (12 Muon matrices, 98,304 weights)
TINY = ModelConfig(family="gpt", num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64)
MUON = MuonJob(exclude=("router", "lora_"), ns_steps=5, ns_dtype="bf16")


def _job(muon: MuonJob | None, **cluster) -> Job:
    return Job(
        model=TINY,
        cluster=ClusterConfig(devices_per_node=2, intra_node_latency_us=0.0, **cluster),
        seq_len=32,
        global_batch=8,
        precision="fp32",
        muon=muon,
    )


def _muon_weights() -> int:
    """Weights of the 2-D tensors inside the blocks, read off the model built on meta."""
    with torch.device("meta"):
        model = Transformer(TINY)
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(sharding=2, stage=1), Layout(sharding=2, stage=3)])
def test_muon_state_is_one_momentum_buffer_per_matrix(layout):
    """The optimizer state is AdamW's minus one fp32 moment per Muon weight, sharded like the rest.
    Fails if the Muon matrices were priced with two moments, or their saving not divided by the
    sharding ranks (or divided under dp, which replicates it)."""
    n = _muon_weights()
    assert n == 98_304
    adamw, muon = state_bytes(_job(None), layout), state_bytes(_job(MUON), layout)
    held = n // 2 if layout.sharding > 1 else n
    assert adamw.optimizer - muon.optimizer == 4 * held
    assert (muon.weights, muon.gradients) == (adamw.weights, adamw.gradients)


def test_newton_schulz_flops_are_what_torch_counts():
    """The FLOPs priced for one orthogonalisation equal torch's count of suite.train.muon.newton_schulz
    on a wide, a tall and a stacked (per-expert) tensor. Fails if the orientation (m <= n), the
    iteration count or the per-expert stack were priced wrong."""
    for shape in ((16, 40), (48, 16), (3, 24, 8)):
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(shape), 5, torch.float32)
        assert newton_schulz_flops(shape, 5) == counter.get_total_flops(), shape


def test_muon_gather_scatter_is_priced_with_the_bytes_the_trainer_reports():
    """Under sharding=2 a rank receives 98,304 fp32 bytes (gather) and sends 49,152 bf16 bytes (scatter)
    per step for this model (what summary.json reports), and does half the Newton-Schulz work; under dp
    it does all of it and sends nothing. Fails if every rank were priced a whole all-gather of every
    matrix (twice the bytes here), the scatter's dtype ignored, or the round-robin split not applied."""
    job = _job(MUON, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12})
    flops = sum(newton_schulz_flops(s, 5) for s in [(64, 64)] * 8 + [(256, 64), (64, 256)] * 2)
    assert muon_time(job, Layout(dp=2), 0) == pytest.approx(flops / 1e12)
    sharded = Layout(sharding=2, stage=3)
    bandwidth = comm.group_link(job.cluster, sharded, "sharding").bandwidth_of("all_to_all")
    expected = flops / 2 / 1e12 + (98_304 + 49_152) / bandwidth
    assert muon_time(job, sharded, 0) == pytest.approx(expected)
    assert muon_time(_job(None), sharded, 0) == 0.0
    tp = Layout(tp=2)  # the same split over the tp ranks: whole matrices, half of them each
    link = comm.group_link(job.cluster, tp, "tp").bandwidth_of("all_to_all")
    assert muon_time(job, tp, 0) == pytest.approx(flops / 2 / 1e12 + (98_304 + 49_152) / link)


def test_the_planner_refuses_the_layouts_muon_refuses():
    """Fails if the planner could propose tp with sharding, or pp, for optim=muon (the trainer refuses
    them), or refused tp alone (which Muon runs, round-robin over the tp ranks)."""
    job = dataclasses.replace(_job(MUON), cluster=ClusterConfig(devices_per_node=4))
    with pytest.raises(ConfigError, match="parallel.tp=2 and parallel.sharding=2"):
        check_layout(job, Layout(tp=2, sharding=2, stage=3))
    with pytest.raises(ConfigError, match="parallel.pp=2"):
        check_layout(job, Layout(pp=2, dp=2))
    check_layout(job, Layout(tp=2, dp=2))
    check_layout(job, Layout(sharding=4, stage=1))
    check_layout(dataclasses.replace(job, muon=None), Layout(tp=2, sharding=2, stage=3))


def test_muon_pays_one_collective_latency_per_matrix_and_pass():
    """With a link latency, the round-robin's gathers and scatters are one collective per matrix: on
    top of the bytes, (12 matrices - 1) x (2 ranks - 1) latencies for each of the two passes. Fails if
    the latency were charged once per step, or per rank pair without the matrix count."""
    job = _job(MUON, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12})
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, intra_node_latency_us=5.0))
    sharded = Layout(sharding=2, stage=3)
    link = comm.group_link(job.cluster, sharded, "sharding")
    assert link.latency > 0
    flops = sum(newton_schulz_flops(s, 5) for s in [(64, 64)] * 8 + [(256, 64), (64, 256)] * 2)
    held = 98_304 // 2  # this rank's rows of the Muon weights: gathered as fp32, scattered as bf16
    expected = flops / 2 / 1e12 + comm.all_to_all(link, held * 4) + comm.all_to_all(link, held * 2)
    assert muon_time(job, sharded, 0) == pytest.approx(expected + 2 * 11 * 1 * link.latency)


def test_muon_experts_are_priced_on_their_rank_without_communication():
    """moe-tiny at the distributed test's size under ep=2: each rank prices Newton-Schulz for its 4 of
    the 8 experts of every stack and none of their bytes; the 8 dense matrices are replicated (dp) or
    dealt round-robin with their gather/scatter (sharding), the bytes summary.json reports for
    tests/distributed/test_muon_layouts.py's ep2-sharding2. Fails if the expert stacks were priced
    as gathered (their bytes), as whole on every rank, or split again by the sharding ranks."""
    moe = dataclasses.replace(
        TINY, family="llama", num_kv_heads=2, num_experts=8, top_k=2, moe_every=1, moe_ffn_hidden_size=64
    )
    job = dataclasses.replace(_job(MUON, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12}), model=moe)
    # 2 layers x wq, wo (64 x 64) and wk, wv (2 kv heads: 32 x 64)
    dense = 2 * (2 * newton_schulz_flops((64, 64), 5) + 2 * newton_schulz_flops((32, 64), 5))
    experts = 2 * 3 * newton_schulz_flops((4, 64, 64), 5)  # 2 layers x w1, w2, w3, 4 experts each
    assert muon_time(job, Layout(dp=2, ep=2), 0) == pytest.approx((dense + experts) / 1e12)
    sharded = Layout(sharding=2, stage=3, ep=2)
    bandwidth = comm.group_link(job.cluster, sharded, "sharding").bandwidth_of("all_to_all")
    # this rank's rows of the dense matrices; the owner receives the other half (fp32), sends bf16
    held = (2 * (2 * 64 * 64 + 2 * 32 * 64)) // 2
    expected = (dense / 2 + experts) / 1e12 + (held * 4 + held * 2) / 2 / bandwidth
    assert muon_time(job, sharded, 0) == pytest.approx(expected)
