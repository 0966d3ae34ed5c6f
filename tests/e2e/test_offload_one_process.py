"""parallel.offload=true in a single process (ZeRO-Offload on one device): a one-rank FSDP2 group
with CPUOffloadPolicy keeps parameters, gradients and AdamW state in host memory. On this CPU the
same code path runs with nothing to move; the run must match the plain single-process run step
for step, say in its layout that it offloaded, and resume from its own checkpoint. The CUDA run
of the same comparison is tests/unit/test_gpu_paths.py::test_offload_trains_on_one_gpu."""

from __future__ import annotations

import pytest

from tests.helpers import TINY_MODEL, read_metrics, run_suite, summary


def _records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def test_one_process_offload_matches_the_plain_run_and_resumes(tmp_path, tiny_data):
    common = [f"data.path={tiny_data}", *TINY_MODEL, "train.device=cpu", "train.log_every=1"]
    run_suite("pretrain", *common, "train.max_steps=3", f"run.dir={tmp_path / 'plain'}", check=True)
    off = tmp_path / "off"
    run_suite("pretrain", *common, "train.max_steps=3", "parallel.offload=true", f"run.dir={off}", check=True)

    layout = summary(off)["layout"]
    assert layout["world_size"] == 1 and layout["data_parallel"] == "fsdp", layout
    assert set(layout["ranks"][0]["modules"]["fsdp_offload"]) == {"<root>", "layers.0", "layers.1"}
    assert summary(tmp_path / "plain")["layout"]["data_parallel"] == "none"

    plain, offloaded = _records(tmp_path / "plain"), _records(off)
    assert plain.keys() == offloaded.keys() == {1, 2, 3}
    for step in plain:
        for key in ("loss", "grad_norm"):
            assert offloaded[step][key] == pytest.approx(plain[step][key], rel=1e-5, abs=1e-7), (step, key)

    # resume the offloaded run from its step-3 checkpoint; the plain run resumes too: same steps 4-5
    run_suite("pretrain", *common, "train.max_steps=5", "parallel.offload=true", f"run.dir={off}", check=True)
    run_suite("pretrain", *common, "train.max_steps=5", f"run.dir={tmp_path / 'plain'}", check=True)
    plain, offloaded = _records(tmp_path / "plain"), _records(off)
    assert {4, 5} <= offloaded.keys()
    for step in (4, 5):
        assert offloaded[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-5), step
