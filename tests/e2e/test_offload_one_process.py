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


def test_one_process_offload_finetunes_and_scores_its_task(tmp_path, tiny_data):
    """SFT's task accuracy decodes with a KV cache inside training; under FSDP (offload here, sharding
    alike) the cache once came out sharded like the parameters and the decode crashed (mixed Tensor
    and DTensor). Offloaded and plain finetuning now score the same."""
    base = tmp_path / "base"
    run_suite(
        "pretrain", f"data.path={tiny_data}", *TINY_MODEL, "train.max_steps=1", f"run.dir={base}", check=True
    )
    common = ["recipe=sft-tiny", f"model.init_from={base}", "data.seq_len=64", "train.precision=fp32"]
    common += ["train.max_steps=1", "finetune.eval_samples=4", "train.device=cpu", "log.wandb=false"]
    run_suite("finetune", *common, f"run.dir={tmp_path / 'plain'}", check=True)
    run_suite("finetune", *common, "parallel.offload=true", f"run.dir={tmp_path / 'off'}", check=True)
    assert summary(tmp_path / "off")["layout"]["data_parallel"] == "fsdp"
    plain = [r for r in read_metrics(tmp_path / "plain") if "val_accuracy" in r]
    off = [r for r in read_metrics(tmp_path / "off") if "val_accuracy" in r]
    assert len(plain) == len(off) >= 1
    for a, b in zip(plain, off):
        assert b["val_accuracy"] == a["val_accuracy"]
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
