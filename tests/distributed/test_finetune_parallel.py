"""Finetuning under parallel layouts matches one process (real `suite finetune` launches).

- dp=2 (full finetuning): per-step losses within 1e-4 of the single-process run. The SFT loss is
  token-weighted over the global batch, so ranks holding different numbers of assistant tokens
  still give one process's loss and gradient.
- LoRA under tp=2: step 1 (adapters still zero: the base model's loss) equals the single-process
  step 1, and the tp-trained checkpoint loads and merges in one process, the merged model giving
  the adapted model's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import STEPS, finetune, tiny_base
from tests.helpers import assert_close_losses, train_losses


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    return tiny_base(tmp_path_factory.mktemp("ftp") / "base-hf", tiny_data)


@pytest.fixture(scope="module")
def single(tmp_path_factory, base) -> Path:
    return finetune(tmp_path_factory.mktemp("ftp") / "single", base, "finetune.eval_samples=0")


def test_dp2_finetune_matches_single_process(tmp_path, base, single):
    run = finetune(
        tmp_path / "dp2", base, "finetune.eval_samples=0", "parallel.dp=2", "launch.nproc_per_node=2"
    )
    assert_close_losses(train_losses(single), train_losses(run), rtol=1e-4)


def test_lora_tp2_matches_then_loads_and_merges_in_one_process(tmp_path, base, single):
    from suite.config.compose import load_saved_config
    from suite.finetune.lora import apply_lora, lora_state_dict
    from suite.infer.generate import load_for_inference
    from suite.models import build_model, materialize
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    run = finetune(
        tmp_path / "lora-tp2",
        base,
        "finetune.method=lora",
        "finetune.lora.rank=4",
        "finetune.eval_samples=0",
        "parallel.tp=2",
        "launch.nproc_per_node=2",
    )
    assert_close_losses({1: train_losses(single)[1]}, {1: train_losses(run)[1]}, rtol=1e-4)
    assert train_losses(run)[STEPS] != train_losses(run)[1]

    folder = resolve_checkpoint(run)
    cfg = load_saved_config(folder / "config.yaml")
    adapted = materialize(build_model(cfg.model), "cpu", seed=0)
    apply_lora(adapted, cfg.finetune.lora.rank, cfg.finetune.lora.alpha)
    load_model_weights(folder, adapted)
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(adapted).items() if ".lora_b." in k)
    merged, _, _ = load_for_inference(run)
    ids = torch.arange(1, 33).view(1, 32)
    with torch.no_grad():
        assert (merged(ids) - adapted(ids)).abs().max() <= 1e-4
