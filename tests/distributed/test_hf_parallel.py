"""HF import and export under tp=2 and sharding=2, with real `suite finetune` launches.

Tiny random models that transformers itself creates and save_pretrained's (Llama with
grouped-query attention, GPT-2 with tied embeddings and its fused, transposed c_attn) are finetuned
from `model.init_from=hf:<folder>`: Llama under tp=2, GPT-2 under sharding=2 (FSDP2). Each rank
reads only its own shard of every tensor (suite.model_source). Checked:

- import: step 1's loss (nothing trained yet: the imported weights) equals the single-process
  import's loss recomputed here, within rtol 1e-4 (fp32), and every step (loss, gradient norm,
  step-1 gradients, weight updates) equals a single-process finetuning run from the same folder;
- export: `suite export` of each run's checkpoint (streamed tensor by tensor from the DCP files,
  written in several safetensors shards here) loads in transformers with logits within 1e-4 of
  the suite model loaded from the same checkpoint.
Three launches of two processes in all; the exports run in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_finetune import STEPS, finetune, first_step_loss_in_process
from tests.helpers import assert_equivalent, assert_layout, export_and_compare, run_suite, train_losses

VOCAB, SEQ = 512, 64


def _save_hf(model, folder: Path, tiny_data: Path) -> Path:
    from suite.data import load_tokenizer

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases too, and logits far from uniform
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and p.dim() == 1  # norm weights: around 1
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if gain else 0.1) + float(gain))
    model.save_pretrained(folder)
    load_tokenizer(tiny_data).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory, tiny_data) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return _save_hf(LlamaForCausalLM(config), tmp_path_factory.mktemp("hfp") / "llama-gqa", tiny_data)


@pytest.fixture(scope="module")
def gpt2_hf(tmp_path_factory, tiny_data) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4)
    return _save_hf(GPT2LMHeadModel(config), tmp_path_factory.mktemp("hfp") / "gpt2", tiny_data)


# These random HF models (weights ~N(0, 0.1)) have gradient elements at AdamW's eps (1e-8), where the
# first update is lr x sign(g) and rounding decides the sign: measured, one element of Llama's 4096
# in layers.0.attention.wo.weight (gradient 1.1e-8 in one process, -7.9e-9 at tp=2) moved 2.4e-4
# apart, 2.0e-3 of the tensor's update; GPT-2's key bias (no true gradient) moves by such noise,
# up to lr x steps = 3e-3. Losses, gradient norms and gradients still agree within 1e-4 (measured
# 1.3e-6, 2.5e-6, 9.3e-7).
IMPORT_TOLERANCES = {"update_rtol": 5e-3, "noise_atol": 3e-3}
# every step's update is measurable (no 20-step warm-up in a 3-step run); step-1 gradients saved
CHECKED = ["finetune.eval_samples=0", "sched.warmup_steps=1", "train.save_grads_step=1"]


def _two_process_finetune(tmp_path_factory, base: Path, name: str, layout: str) -> Path:
    run = tmp_path_factory.mktemp("hfp") / name
    return finetune(run, base, *CHECKED, layout, "launch.nproc_per_node=2")


@pytest.fixture(scope="module")
def llama_single(tmp_path_factory, llama_hf) -> Path:
    return finetune(tmp_path_factory.mktemp("hfp") / "llama-single", llama_hf, *CHECKED)


@pytest.fixture(scope="module")
def gpt2_single(tmp_path_factory, gpt2_hf) -> Path:
    return finetune(tmp_path_factory.mktemp("hfp") / "gpt2-single", gpt2_hf, *CHECKED)


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory, llama_hf) -> Path:
    return _two_process_finetune(tmp_path_factory, llama_hf, "llama-tp2", "parallel.tp=2")


@pytest.fixture(scope="module")
def gpt2_sharded(tmp_path_factory, gpt2_hf) -> Path:
    return _two_process_finetune(tmp_path_factory, gpt2_hf, "gpt2-sharding2", "parallel.sharding=2")


@pytest.mark.parametrize("layout", ["llama_tp2", "gpt2_sharded"])
def test_import_under_parallelism_matches_single_process(request, layout):
    run = request.getfixturevalue(layout)
    base = request.getfixturevalue(layout.split("_")[0] + "_hf")
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    expected = first_step_loss_in_process(run, base)
    assert abs(losses[1] - expected) <= 1e-4 * expected, (losses[1], expected)
    # and every later step: the same training as the import in one process
    assert_layout(run, 2, ["parallel.tp=2"] if layout == "llama_tp2" else ["parallel.sharding=2"])
    assert_equivalent(request.getfixturevalue(layout.split("_")[0] + "_single"), run, **IMPORT_TOLERANCES)


@pytest.mark.parametrize("layout", ["llama_tp2", "gpt2_sharded"])
def test_export_of_a_parallel_checkpoint_loads_in_transformers(request, tmp_path, layout):
    run = request.getfixturevalue(layout)
    # shards of at most 0.2 MB: several files and an index, each written from the tensors it holds
    assert export_and_compare(run, tmp_path / "hf", **{"export.max_shard_mb": 0.2}) <= 1e-4
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


def test_pretrain_from_hf_under_tp2_starts_from_the_imported_weights(tmp_path, gpt2_hf, tiny_data):
    """Continued pretraining: step 1's loss is the imported GPT-2's loss on the first global batch."""
    import torch.nn.functional as F

    from suite.config.schema import TrainConfig
    from suite.data.loader import TokenBatches
    from suite.model_source import load_hf_model

    run = tmp_path / "gpt2-pretrain-tp2"
    run_suite(
        "pretrain",
        f"model.init_from=hf:{gpt2_hf}",
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "data.seq_len=32",
        "train.max_steps=1",
        "train.eval_batches=1",
        "train.precision=fp32",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=4",
        "parallel.tp=2",
        "launch.nproc_per_node=2",
        "log.wandb=false",
        "log.progress=false",
        check=True,
    )
    model, _ = load_hf_model(gpt2_hf)
    batches = TokenBatches(tiny_data, "train", 32, 2, 4, seed=TrainConfig.seed).next_step()
    with torch.no_grad():
        losses = [F.cross_entropy(model(b.tokens).flatten(0, 1), b.labels.flatten()) for b in batches]
    expected = float(torch.stack(losses).mean())
    assert abs(train_losses(run)[1] - expected) <= 1e-4 * expected, (train_losses(run)[1], expected)
