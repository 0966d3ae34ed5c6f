"""A run made from an imported instruct model keeps the model's chat template and special tokens
(issue 43), and every export carries them to transformers and llama.cpp.

The "instruct model" is a tiny seeded GPT saved as an HF folder whose tokenizer is the tiny corpus's
plus ChatML's two special tokens, with bos `<|im_start|>` and eos `<|im_end|>` (as SmolLM2's: bos 1,
eos 2) and a ChatML template. `suite pretrain model.init_from=hf:<it> data.tokenizer=<it>` (one
command: the data is prepared with the model's tokenizer) trains two steps; its HF and GGUF exports
are read the way users read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_suite

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse 123."}]
STEPS = [
    "train.max_steps=2", "train.save_every=2", "train.eval_every=2", "data.seq_len=32",
    "parallel.micro_batch_size=2", "parallel.global_batch_size=2", "train.precision=fp32",
    "log.wandb=false", "log.progress=false", "log.report=false",
]  # fmt: skip


def instruct_base(folder: Path, tiny_data: Path) -> Path:
    """A 2-layer GPT with a ChatML tokenizer (bos <|im_start|> != eos <|im_end|>) as an HF folder."""
    from suite.config.schema import ModelConfig
    from suite.data import load_tokenizer
    from suite.export.hf import export_hf
    from suite.models import build_model, materialize

    tokenizer = load_tokenizer(tiny_data)
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        }
    )
    tokenizer.chat_template = CHATML
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=len(tokenizer), max_seq_len=64)
    return export_hf(materialize(build_model(cfg), "cpu", seed=7), cfg, folder, tokenizer)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data) -> Path:
    return instruct_base(tmp_path_factory.mktemp("instruct") / "hf", tiny_data)


@pytest.fixture(scope="module")
def run(tmp_path_factory, base) -> Path:
    root = tmp_path_factory.mktemp("from-instruct")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"Document {i}: the cat sat on mat {i}."}) + "\n" for i in range(200))
    )
    run_dir = root / "run"
    run_suite(
        "pretrain", f"model.init_from=hf:{base}", f"data.tokenizer={base}", f"data.sources=[{{path: {corpus}}}]",
        f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.1", f"run.dir={run_dir}", *STEPS, check=True,
    )  # fmt: skip
    return run_dir


def test_the_base_folder_keeps_its_own_bos(base):
    """Writing the instruct folder itself (export_hf of a model + tokenizer) keeps bos <|im_start|>; the
    old rule (bos = eos) wrote <|im_end|>'s id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    config = json.loads((base / "config.json").read_text())
    assert tokenizer.bos_token_id != tokenizer.eos_token_id
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )


def test_pretraining_from_an_instruct_model_keeps_its_template_and_ids(run, base, tmp_path):
    """The run folder holds the template (chat_template.jinja beside tokenizer.json); its HF export makes
    apply_chat_template render what the base renders, with the base's bos/eos ids in config.json and
    generation_config.json; its GGUF export carries the template and the same ids to llama.cpp."""
    import gguf
    from transformers import AutoTokenizer

    from suite.cli import main
    from suite.data import load_tokenizer

    assert load_tokenizer(run).chat_template == CHATML
    want = AutoTokenizer.from_pretrained(base).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    hf = tmp_path / "hf"
    assert main(["export", f"ckpt={run}", f"out={hf}"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == want
    base_ids = {
        k: json.loads((base / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id")
    }
    for file in ("config.json", "generation_config.json"):
        written = json.loads((hf / file).read_text())
        assert {k: written[k] for k in base_ids} == base_ids, file
    out = tmp_path / "gguf"
    assert main(["export", f"ckpt={run}", f"out={out}", "format=gguf"]) == 0
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    assert reader.get_field("tokenizer.chat_template").contents() == CHATML
    assert reader.get_field("tokenizer.ggml.bos_token_id").contents() == base_ids["bos_token_id"]
    assert reader.get_field("tokenizer.ggml.eos_token_id").contents() == base_ids["eos_token_id"]


def test_data_in_another_tokenizer_than_the_models_is_refused(base, tiny_data, tmp_path):
    """model.init_from with data prepared in another tokenizer (the tiny corpus's, without the model's
    two ChatML tokens) trained every id as another token and nothing failed: now one line naming the
    tokenizer to prepare with (the `run` fixture above is that fix, run). Fails without the check."""
    from tests.e2e.test_run_folders import assert_one_line

    run_dir = tmp_path / "run"
    proc = run_suite(
        "pretrain", f"model.init_from=hf:{base}", f"data.path={tiny_data}", f"run.dir={run_dir}", *STEPS
    )
    assert_one_line(proc, 2, "model.init_from=", "another", f"data.tokenizer={base}")
    assert not run_dir.exists()
