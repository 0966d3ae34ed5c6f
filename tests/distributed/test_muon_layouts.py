"""optim=muon under data parallelism, sharding, tensor and expert parallelism trains like one process
(fp32, gloo, real processes): the same loss and gradient norm at every step, the same step-1 gradients
and the same updates of every parameter (tests/helpers.py: assert_equivalent), and the layout that ran
is the one asked for. Expert parallelism on moe-tiny (TINY_MODEL-sized, 8 experts: 2 layers x 3
stacked expert weights = 48 expert matrices), against moe-tiny on one process."""

from __future__ import annotations

import math

import pytest
import torch.distributed.checkpoint as dcp

from tests.distributed.conftest import pretrain
from tests.helpers import TINY_MODEL, assert_equivalent, assert_layout, summary

# loading a checkpoint into a plain model in this (non-distributed) test process is the intent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 3  # enough for momentum to matter (steps 2-3) and for a wrong update to show in the losses
# fp32 Newton-Schulz: in bf16 (the default, torch's) a 1e-7 difference in the averaged gradient flips
# roundings and the updates agree only to ~5e-3; the distributed code is the same in either dtype.
# save_every=1: a step-1 checkpoint, for the step-1 updates
MUON = ["optim=muon", "optim.muon_ns_dtype=fp32", "sched=wsd", "train.save_every=1"]
LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "sharding2-stage1": ["parallel.sharding=2", "parallel.sharding_stage=1"],
    "sharding2-stage3": ["parallel.sharding=2", "parallel.sharding_stage=3"],
    # column- (Shard(0)) and row-parallel (Shard(1)) matrices, gathered whole from the tp ranks
    "tp2": ["parallel.tp=2"],
}
# moe-tiny at the tests' size (tests/distributed/test_moe.py's MOE), constant lr after the warm-up
MOE = ["recipe=moe-tiny", *TINY_MODEL, "model.num_kv_heads=2", "model.moe_ffn_hidden_size=64"]
MOE_LAYOUTS = {
    # dense weights replicated (dp), each rank holds 4 of the 8 experts of every stack
    "ep2-dp2": ["parallel.dp=2", "parallel.ep=2"],
    # dense weights sharded by FSDP2 (round-robin Newton-Schulz), the experts split over ep
    "ep2-sharding2": ["parallel.sharding=2", "parallel.ep=2"],
    # ZeRO-1: the dense AdamW/Muon state in row slices (round-robin), the experts kept whole per rank
    "ep2-zero1": ["parallel.sharding=2", "parallel.sharding_stage=1", "parallel.ep=2"],
    # no ep: FSDP2's Shard(0) rows of a [8, out, in] stack are 4 whole experts per rank too
    "sharding2": ["parallel.sharding=2"],
}


@pytest.fixture(scope="module")
def muon_single(tiny_data, tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("muon") / "single", tiny_data, 1, *MUON, steps=STEPS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_single_process(muon_single, tiny_data, tmp_path, name):
    """Fails if a rank orthogonalised its own shard instead of the whole matrix (ZeRO-1 slices, FSDP2
    shards: the updates then differ from one process's), if a rank's momentum missed the averaged
    gradient, or if the Muon/AdamW grouping depended on the layout's parameter names.

    The work and communication (summary.json `muon_per_step`): under sharding and tp every matrix is
    orthogonalised once over both ranks, dealt round-robin (the counts differ by at most one), and
    its owner gathers and scatters the other rank's half of it; fails if every rank gathered and
    orthogonalised every matrix, or if the owners were chosen differently on the two ranks (a
    matrix done twice or never: the total would be off, or the collectives would not match up).
    Under dp every rank orthogonalises every matrix, with no communication."""
    run = pretrain(tmp_path / name, tiny_data, 2, *MUON, *LAYOUTS[name], steps=STEPS)
    assert_layout(run, 2, LAYOUTS[name])
    assert_equivalent(muon_single, run, to_step=1)  # step-1 gradients and updates within 1e-4
    assert_equivalent(muon_single, run, grad_step=None)  # every step's loss and norm, the final updates
    shapes = _muon_matrices(muon_single)
    work = summary(run)["muon_per_step"]
    assert summary(muon_single)["muon_per_step"]["orthogonalised"] == [len(shapes)]
    if name == "dp2":
        assert work == {
            "orthogonalised": [len(shapes)] * 2,
            "gathered_bytes": [0, 0],
            "scattered_bytes": [0, 0],
        }
        return
    done = work["orthogonalised"]
    assert sum(done) == len(shapes) and max(done) - min(done) <= 1, (done, len(shapes))
    half = sum(4 * math.prod(s) for s in shapes) // 2  # fp32 rows of the other rank (even row counts)
    assert sum(work["gathered_bytes"]) == half and sum(work["scattered_bytes"]) == half, work
    assert min(work["gathered_bytes"]) > 0, work  # both ranks own matrices


@pytest.fixture(scope="module")
def muon_moe_single(tiny_data, tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("muon-moe") / "single", tiny_data, 1, *MOE, *MUON, steps=STEPS)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_muon_moe_layout_matches_single_process(muon_moe_single, tiny_data, tmp_path, name):
    """ep=2 (or FSDP2 alone): each rank holds 4 whole experts of every [8, out, in] stack and
    orthogonalises them itself, once, with no communication; the dense matrices follow dp's rule (every rank, from the same
    averaged gradient) or sharding's (round-robin, gathered and scattered). Fails if a rank's expert
    stack were orthogonalised as one matrix or the lr adjusted by its first two dims (the updates
    differ from one process's), if the experts were gathered whole (bytes sent for them) or
    orthogonalised on every rank (each rank's count would include all 48), or skipped."""
    run = pretrain(tmp_path / name, tiny_data, 2, *MOE, *MUON, *MOE_LAYOUTS[name], steps=STEPS)
    assert_layout(run, 2, MOE_LAYOUTS[name])
    assert_equivalent(muon_moe_single, run, to_step=1)
    assert_equivalent(muon_moe_single, run, grad_step=None)
    shapes = _muon_matrices(muon_moe_single)
    experts = sum(s[0] for s in shapes if len(s) == 3)
    dense = [s for s in shapes if len(s) == 2]
    assert experts == 48 and len(dense) == 8, shapes
    assert summary(muon_moe_single)["muon_per_step"]["orthogonalised"] == [experts + len(dense)]
    work = summary(run)["muon_per_step"]
    if name == "ep2-dp2":
        assert work == {
            "orthogonalised": [len(dense) + experts // 2] * 2,
            "gathered_bytes": [0, 0],
            "scattered_bytes": [0, 0],
        }
        return
    done = [n - experts // 2 for n in work["orthogonalised"]]  # the dense ones, round-robin
    assert sum(done) == len(dense) and max(done) - min(done) <= 1, (work, len(dense))
    half = sum(4 * math.prod(s) for s in dense) // 2  # only the dense matrices travel
    assert sum(work["gathered_bytes"]) == half and sum(work["scattered_bytes"]) == half, work


def _muon_matrices(run) -> list[tuple[int, ...]]:
    """The shapes of the Muon matrices (one momentum buffer each) in the run's step-1 checkpoint."""
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step_1")).read_metadata().state_dict_metadata
    shapes = [tuple(m.size) for k, m in meta.items() if k.endswith("momentum_buffer")]
    assert shapes and all(s[0] % 2 == 0 for s in shapes), shapes
    return shapes
