"""`suite finetune` (full and LoRA), `suite eval` and `suite export merge_lora=true`, as a user runs them.

The base is a tiny random GPT exported to an HF folder in-process (so it also covers
model.init_from=hf:<folder>), with the tiny corpus's tokenizer; the task is a small generated
reverse-3. Two finetuning runs (full, LoRA), one export and one eval: four launches in all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import read_metrics, run_suite

STEPS = 3
TINY_FT = [
    "log.wandb=false",
    "log.progress=false",
    "data.seq_len=64",
    "finetune.data.task=reverse-3",
    "finetune.data.num_train=48",
    "finetune.data.num_eval=8",
    "finetune.eval_samples=2",
    f"train.max_steps={STEPS}",
    f"train.eval_every={STEPS}",
    f"train.save_every={STEPS}",
    "train.log_every=1",
    "parallel.micro_batch_size=2",
    "parallel.global_batch_size=4",
    "optim.lr=1e-3",
    "train.precision=fp32",
]


def tiny_base(folder: Path, tiny_data: Path) -> Path:
    """A seeded 2-layer GPT (vocab 512, 64 positions) saved as an HF folder with the tiny tokenizer."""
    from suite.config.schema import ModelConfig
    from suite.data import load_tokenizer
    from suite.export.hf import export_hf
    from suite.models import build_model, materialize

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64)
    model = materialize(build_model(cfg), "cpu", seed=7)
    return export_hf(model, cfg, folder, load_tokenizer(tiny_data))


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    return tiny_base(tmp_path_factory.mktemp("ft") / "base-hf", tiny_data)


def finetune(run_dir: Path, base: Path, *extra: str) -> Path:
    run_suite("finetune", f"model.init_from=hf:{base}", f"run.dir={run_dir}", *TINY_FT, *extra, check=True)
    return run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, base) -> Path:
    return finetune(tmp_path_factory.mktemp("ft") / "full", base)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base) -> Path:
    return finetune(
        tmp_path_factory.mktemp("ft") / "lora", base, "finetune.method=lora", "finetune.lora.rank=4"
    )


def first_step_loss_in_process(run_dir: Path, base: Path) -> float:
    """Step 1's loss recomputed here: masked cross-entropy summed over the first global batch's
    assistant tokens, divided by their number, with the base model (nothing trained yet)."""
    from suite.config.compose import load_saved_config
    from suite.data import load_tokenizer
    from suite.data.batch import IGNORE_INDEX
    from suite.data.sft import SFTBatches, SFTDataset
    from suite.finetune.data import sft_options
    from suite.model_source import load_hf_model
    from suite.train.loss import cross_entropy

    cfg = load_saved_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir)
    data = SFTDataset.build(
        str(run_dir / "task" / "train.jsonl"), tokenizer, sft_options(cfg, tokenizer.chat_template)
    )
    batches = SFTBatches(data, 2, 4, seed=cfg.train.seed).next_step()
    model, _ = load_hf_model(base)
    with torch.no_grad():
        total = sum(
            float(cross_entropy(model(b.tokens, **b.model_kwargs()), b.labels, "sum")) for b in batches
        )
    targets = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    assert 0 < targets < sum(b.tokens.numel() for b in batches)  # prompts and padding are masked
    return total / targets


def test_full_finetune_logs_masked_loss_and_task_accuracy(full_run, base):
    metrics = read_metrics(full_run)
    losses = {r["step"]: r["loss"] for r in metrics if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    evals = [r for r in metrics if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, STEPS]
    # 3 warm-up steps do not teach the task; that finetuning learns: test_finetuning_learns_what_it_is_taught
    assert all(0.0 <= r["val_accuracy"] <= 1.0 for r in evals)
    # the CLI's step-1 loss is the token-weighted loss over assistant tokens only
    assert abs(losses[1] - first_step_loss_in_process(full_run, base)) <= 1e-4 * losses[1]
    # the chat template trained with is kept beside the tokenizer
    assert "<|im_start|>" in (full_run / "chat_template.jinja").read_text()


def test_lora_trains_and_saves_only_adapters(lora_run, base):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from suite.model_source import load_hf_model

    adapters = load_file(str(lora_run / "lora" / "lora.safetensors"))
    assert adapters and all(".lora_a." in k or ".lora_b." in k for k in adapters)
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_b." in k)  # B moved off zero
    assert json.loads((lora_run / "lora" / "lora.json").read_text())["rank"] == 4
    ckpt = lora_run / "checkpoints" / f"step_{STEPS}"
    assert (ckpt / "lora" / "lora.safetensors").is_file()
    # the optimizer holds state for adapters only
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    # the base weights are frozen: bitwise the base model's
    base_model, _ = load_hf_model(base)
    weights = final_weights_with_lora(lora_run)
    for name, value in base_model.state_dict().items():
        assert torch.equal(weights[name], value), name


def final_weights_with_lora(run_dir: Path) -> dict[str, torch.Tensor]:
    from suite.config.compose import load_saved_config
    from suite.models import build_model, materialize
    from suite.models.lora import apply_lora
    from suite.train.checkpoint import load_model_weights, resolve_checkpoint

    folder = resolve_checkpoint(run_dir)
    cfg = load_saved_config(folder / "config.yaml")
    model = materialize(build_model(cfg.model), "cpu", seed=0)
    apply_lora(model, cfg.finetune.lora.rank, cfg.finetune.lora.alpha)
    load_model_weights(folder, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lora_export_merges_and_loads_in_transformers(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from suite.infer.generate import load_for_inference

    refused = run_suite("export", f"ckpt={lora_run}", f"out={tmp_path / 'no'}")
    assert refused.returncode == 2 and "merge_lora=true" in refused.stderr
    out = tmp_path / "hf"
    run_suite("export", f"ckpt={lora_run}", f"out={out}", "merge_lora=true", check=True)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and (out / "chat_template.jinja").is_file()
    ours, _, _ = load_for_inference(lora_run)  # adapters merged
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse 123."}], tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max()
    assert diff <= 1e-4


def test_eval_prints_held_out_accuracy(full_run):
    proc = run_suite("eval", f"ckpt={full_run}", "eval.num_samples=4", "--json", check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["task"] == "reverse-3" and result["total"] == 4
    # 3 steps from a random base: the held-out exact match is 0 (what a model that learned scores
    # is checked in test_finetuning_learns_what_it_is_taught)
    assert result["accuracy"] == 0.0 and result["correct"] == 0


def test_eval_scores_no_more_than_the_held_out_questions(full_run):
    """eval.num_samples past the run's finetune.data.num_eval (8) would score questions the run
    trained on (the task's rows after the held-out ones): capped at 8 with a note. Without the cap
    `total` is 50."""
    proc = run_suite("eval", f"ckpt={full_run}", "eval.num_samples=50", "--json", check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["total"] == 8
    assert "eval.num_samples=50 is more than the 8 questions the run held out" in proc.stderr


@pytest.mark.slow
def test_finetuning_learns_what_it_is_taught(tmp_path, base):
    """A model that learns is told from one that does not: 100 steps on 16 reverse-3 questions take
    the loss down by 90% and the greedy exact match on those questions from 0 to at least half
    (chance: about 1 in 900 three-digit answers). The held-out questions stay out of reach of a
    2-layer random base with 16 examples; bench/finetune.py measures held-out accuracy on the
    demo model (docs/finetuning.md)."""
    from suite.infer.evaluate import evaluate_task
    from suite.infer.generate import load_for_inference

    run = finetune(
        tmp_path / "learn",
        base,
        "finetune.data.num_train=16",
        "finetune.eval_samples=0",
        "train.max_steps=100",
        "train.eval_every=100",
        "train.save_every=100",
        "train.log_every=10",
        "parallel.global_batch_size=8",
        "parallel.micro_batch_size=4",
        "optim.lr=3e-3",
        "sched.warmup_steps=1",
    )
    losses = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert losses[100] < 0.1 * losses[10], losses

    def accuracy(model, tokenizer) -> float:
        trained = run / "task" / "train.jsonl"
        return evaluate_task(model, tokenizer, "reverse-3", trained, max_new_tokens=6)["accuracy"]

    model, tokenizer, _ = load_for_inference(run)
    learned = accuracy(model, tokenizer)
    base_model, _, _ = load_for_inference(f"hf:{base}")
    assert accuracy(base_model, tokenizer) == 0.0
    assert learned >= 0.5, learned


def test_finetune_without_a_base_is_one_line(tmp_path):
    proc = run_suite("finetune", f"run.dir={tmp_path}", "model.init_from=null", "log.wandb=false")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "model.init_from" in proc.stderr


def test_hf_and_gguf_exports_render_the_same_chat_prompt(full_run, tmp_path):
    """The chat template a run trained with reaches llama.cpp: the GGUF export's
    tokenizer.chat_template, rendered by llama.cpp's chat handler (llama-cpp-python's Jinja2ChatFormatter
    built as `Llama` builds it: the file's template and its bos/eos texts), gives the prompt string
    transformers' apply_chat_template gives on the HF export. Without the key llama.cpp falls back to
    the llama-2 format (`chat_format`), and the GGUF has no template to render."""
    import gguf
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from transformers import AutoTokenizer

    from suite.cli import main

    assert main(["export", f"ckpt={full_run}", f"out={tmp_path / 'hf'}"]) == 0
    assert main(["export", f"ckpt={full_run}", f"out={tmp_path / 'gguf'}", "format=gguf"]) == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse 123."}]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    llama = Llama(str(next((tmp_path / "gguf").glob("*.gguf"))), vocab_only=True, verbose=False)
    assert llama.chat_format != "llama-2"  # the file's template (or the built-in format it is), no fallback
    formatter = Jinja2ChatFormatter(
        template=llama.metadata["tokenizer.chat_template"],
        eos_token=llama._model.token_get_text(llama.token_eos()),
        bos_token=llama._model.token_get_text(llama.token_bos()),
    )
    assert formatter(messages=messages).prompt == want
    assert want.endswith("<|im_start|>assistant\n")
    # that file as a gguf: source, exported again: its template and its own pre-tokenizer name ('refact',
    # which transformers' rebuild of the tokenizer drops: detected from it, the name would be 'gpt-2')
    again = tmp_path / "again"
    assert main(["export", f"ckpt=gguf:{llama.model_path}", f"out={again}", "format=gguf"]) == 0
    reader = gguf.GGUFReader(next(again.glob("*.gguf")))
    assert reader.get_field("tokenizer.chat_template").contents() == llama.metadata["tokenizer.chat_template"]
    assert (
        reader.get_field("tokenizer.ggml.pre").contents() == llama.metadata["tokenizer.ggml.pre"] == "refact"
    )
