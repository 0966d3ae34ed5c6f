"""Finetuning under parallel layouts matches one process (real `suite finetune` launches).

- dp=2 (full finetuning): every step's loss and gradient norm, the step-1 gradients and the weight
  updates match the single-process run (tests/helpers.py: assert_equivalent). The SFT loss is
  token-weighted over the global batch, so ranks holding different numbers of assistant tokens
  still give one process's loss and gradient.
- cp=2 and pp=2 (1f1b) with packed samples: the same checks against the same single process.
- LoRA under tp=2: matches a LoRA run in one process the same way (adapters compared, base frozen),
  and the tp-trained checkpoint loads and merges in one process: the merged model gives
  the adapted model's logits (so do the adapters alone, <run.dir>/lora/, loaded onto the HF base
  and merged) and the held-out loss the tp=2 model logged after its last step
  (within 1e-4), and `suite export merge_lora=true` of it loads in transformers with logits within
  1e-4 of the merged model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import STEPS, finetune, tiny_base
from tests.helpers import assert_equivalent, assert_layout, export_and_compare, read_metrics, train_losses


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    return tiny_base(tmp_path_factory.mktemp("ftp") / "base-hf", tiny_data)


# every step's update is measurable (no 20-step warm-up in a 3-step run); step-1 gradients saved
CHECKED = ["finetune.eval_samples=0", "sched.warmup_steps=1", "train.save_grads_step=1"]
LORA = ["finetune.method=lora", "finetune.lora.rank=4"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, base) -> Path:
    return finetune(tmp_path_factory.mktemp("ftp") / "single", base, *CHECKED)


def test_dp2_finetune_matches_single_process(tmp_path, base, single):
    """Token-weighted SFT loss over the global batch: every step's loss and gradient norm, the
    step-1 gradients and the weight updates equal one process's."""
    overrides = [*CHECKED, "parallel.dp=2"]
    run = finetune(tmp_path / "dp2", base, *overrides, "launch.nproc_per_node=2")
    assert_layout(run, 2, overrides)
    assert_equivalent(single, run)


@pytest.mark.parametrize(
    "layout",
    [["parallel.cp=2"], ["parallel.pp=2", "parallel.pp_schedule=1f1b"]],
    ids=["cp2", "pp2-1f1b"],
)
def test_sft_under_cp_and_pp_matches_single_process(tmp_path, base, single, layout):
    """Packed SFT rows (positions restarting per sample, the document mask) under context parallelism
    (each rank its sequence chunks, the one token-weighted loss over every chunk) and pipeline
    parallelism (positions and mask passed to every stage): every step's loss and gradient norm,
    the step-1 gradients and the weight updates equal one process's."""
    overrides = [*CHECKED, *layout]
    run = finetune(tmp_path / "layout", base, *overrides, "launch.nproc_per_node=2")
    assert_layout(run, 2, overrides)
    assert_equivalent(single, run)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused-projections"])
def test_lora_tp2_matches_then_loads_and_merges_in_one_process(tmp_path, base, fused):
    """LoRA at tp=2 trains its adapters like a LoRA run in one process (every step, step-1 adapter
    gradients, adapter updates; the base stays frozen bit for bit). With
    model.fused_projections=true the HF base is imported into wqkv (each tp rank its whole
    head groups), LoRA adapts the fused layer, and merge / export give back the unfused HF names."""
    from suite.config.compose import load_saved_config
    from suite.infer.generate import load_for_inference
    from suite.models import build_model, materialize
    from suite.models.lora import apply_lora, lora_state_dict
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    overrides = [*CHECKED, *LORA, f"model.fused_projections={str(fused).lower()}"]
    reference = finetune(tmp_path / "lora-single", base, *overrides)
    run = finetune(tmp_path / "lora-tp2", base, *overrides, "parallel.tp=2", "launch.nproc_per_node=2")
    assert_layout(run, 2, [*overrides, "parallel.tp=2"])
    assert_equivalent(reference, run)
    assert train_losses(run)[STEPS] != train_losses(run)[1]

    folder = resolve_checkpoint(run)
    cfg = load_saved_config(folder / "config.yaml")
    adapted = materialize(build_model(cfg.model), "cpu", seed=0)
    apply_lora(adapted, cfg.finetune.lora.rank, cfg.finetune.lora.alpha)
    load_model_weights(folder, adapted)
    assert fused == any(".wqkv.lora_a." in k for k in lora_state_dict(adapted))
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(adapted).items() if ".lora_b." in k)
    merged, _, _ = load_for_inference(run)
    ids = torch.arange(1, 33).view(1, 32)
    with torch.no_grad():
        assert (merged(ids) - adapted(ids)).abs().max() <= 1e-4
    # the adapters alone (<run.dir>/lora/, gathered from the tp ranks) on the HF base, merged
    from suite.model_source import load_hf_weights
    from suite.models.lora import load_lora, merge_lora

    from_adapters = materialize(build_model(cfg.model), "cpu", seed=0)
    load_hf_weights(from_adapters, base, cfg.model.fused_projections)
    merge_lora(load_lora(from_adapters, run / "lora"))
    with torch.no_grad():
        assert (from_adapters(ids) - merged(ids)).abs().max() <= 1e-4
    logged = [r["val_loss"] for r in read_metrics(run) if r.get("step") == STEPS and "val_loss" in r]
    assert abs(held_out_loss(run, merged) - logged[0]) <= 1e-4 * logged[0]
    # the export streams the tp=2 checkpoint tensor by tensor, folding the adapters in
    assert export_and_compare(run, tmp_path / "hf", merge_lora="true") <= 1e-4


def held_out_loss(run_dir: Path, model) -> float:
    """The held-out loss as the trainer logs it (token-weighted over train.eval_batches batches)."""
    from suite.config.compose import load_saved_config
    from suite.data import load_tokenizer
    from suite.data.batch import IGNORE_INDEX
    from suite.data.sft import SFTBatches, SFTDataset
    from suite.finetune.data import sft_options
    from suite.train.loss import cross_entropy

    cfg = load_saved_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir)
    data = SFTDataset.build(
        str(run_dir / "task" / "eval.jsonl"), tokenizer, sft_options(cfg, tokenizer.chat_template)
    )
    rows = min(cfg.parallel.micro_batch_size, len(data))
    batches = SFTBatches(data, rows, rows, seed=cfg.train.seed, split="held-out").eval_batches(
        cfg.train.eval_batches
    )
    with torch.no_grad():
        total = sum(
            float(cross_entropy(model(b.tokens, **b.model_kwargs()), b.labels, "sum")) for b in batches
        )
    return total / sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
