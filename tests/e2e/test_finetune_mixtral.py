"""An imported Mixtral folder finetunes with LoRA and its merged export loads in transformers.

The base is a tiny random `MixtralForCausalLM` (2 layers, 4 experts, top-2) saved with
transformers' own save_pretrained, plus the tiny corpus's tokenizer; `suite finetune
model.init_from=hf:<folder> finetune.method=lora` adapts attention and every expert (w1/w2/w3 name
the stacked expert weights), then `suite export merge_lora=true` folds the per-expert adapters into
the experts and writes a Mixtral folder again. Two launches (finetune, export in-process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import finetune
from tests.helpers import export_and_compare, train_losses

STEPS = 3


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, tiny_data) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    from suite.data import load_tokenizer

    folder = tmp_path_factory.mktemp("mixtral") / "base"
    torch.manual_seed(0)
    hf = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            sliding_window=None,
        )
    )
    hf.save_pretrained(folder)
    load_tokenizer(tiny_data).save_pretrained(folder)
    return folder


def test_mixtral_lora_finetune_and_merged_export_match_transformers(tmp_path, mixtral):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from suite.config.compose import load_saved_config
    from suite.models import build_model, materialize
    from suite.models.lora import apply_lora
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    run = finetune(
        tmp_path / "lora",
        mixtral,
        "finetune.method=lora",
        "finetune.lora.rank=4",
        "finetune.eval_samples=0",
        "optim.lr=1e-2",
        "sched.warmup_steps=1",
    )
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    adapters = load_file(str(run / "lora" / "lora.safetensors"))
    assert adapters["layers.0.feed_forward.experts.lora_a.w1"].shape == (4, 4, 64)  # [E, rank, hidden]
    for name in ("experts.lora_b.w1", "experts.lora_b.w2", "experts.lora_b.w3"):
        assert float(adapters[f"layers.1.feed_forward.{name}"].abs().max()) > 0, name
    assert float(adapters["layers.1.attention.wq.lora_b.weight"].abs().max()) > 0

    # the suite's model as it trained: base + adapters, computed low-rank inside the experts
    folder = resolve_checkpoint(run)
    cfg = load_saved_config(folder / "config.yaml")
    assert cfg.model.num_experts == 4 and cfg.model.top_k == 2
    adapted = materialize(build_model(cfg.model), "cpu", seed=0).eval()
    lo = cfg.finetune.lora
    apply_lora(adapted, lo.rank, lo.alpha, lo.dropout, tuple(lo.target_modules))
    load_model_weights(folder, adapted)

    out = tmp_path / "hf"
    # the export streams the checkpoint, folding B[e] A[e] into each expert's weight
    assert export_and_compare(run, out, merge_lora="true") <= 1e-4
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(mixtral).eval()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs, before = adapted(ids), exported(ids).logits, base(ids).logits
    assert float((theirs - ours).abs().max()) <= 1e-4
    assert float((theirs - before).abs().max()) > 1e-2  # the finetuning changed the model measurably
