"""HF folder -> `suite export` -> HF folder: the special-token ids stay the source's, none is ever
outside the vocabulary, and the folder loads in transformers (the export checks that itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from suite.config.schema import ModelConfig
from suite.export.hf import export_checkpoint_hf, export_hf
from suite.export.special import KEYS
from suite.export.verify import ExportCheckFailed, verify_hf_folder
from suite.models import build_model, materialize

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _model(family: str, ids: dict):
    """A tiny random transformers model of `family` whose config holds `ids`."""
    if family == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, **ids)
        )
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, **ids))
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True, **ids))


def _tokenizer(added_eos: str | None = None) -> PreTrainedTokenizerFast:
    """VOCAB word-level tokens, <s> </s> <pad> among them (ids 1, 2, 3); `added_eos` is added after
    them, at id VOCAB: past the model's vocabulary, as some Qwen2 folders' <|endoftext|> is."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if added_eos is not None:
        fast.add_special_tokens({"eos_token": added_eos, "pad_token": added_eos})
    return fast


def _hf_folder(folder: Path, family: str, ids: dict, generation: dict | None = None, added_eos=None) -> Path:
    """save_pretrained of a random model with `ids` in config.json (and `generation`'s in
    generation_config.json when given) and a tokenizer."""
    torch.manual_seed(0)
    model = _model(family, ids).eval()
    model.save_pretrained(folder)
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(folder)
    _tokenizer(added_eos).save_pretrained(folder)
    return folder


def _ids(folder: Path, file: str) -> dict:
    values = json.loads((folder / file).read_text())
    return {key: values.get(key) for key in KEYS}


def _assert_loads_alike(source: Path, out: Path) -> None:
    expected = AutoModelForCausalLM.from_pretrained(source).eval()
    got = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(TOKENS).logits, expected(TOKENS).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_round_trip_keeps_the_special_ids_and_loads(tmp_path, family):
    """config.json's ids and generation_config.json's (a list of eos ids, as Llama 3 has) come back
    as the source wrote them, though the tokenizer names other ids."""
    ids = {"bos_token_id": 11, "eos_token_id": 12, "pad_token_id": 13}
    generation = {"bos_token_id": 11, "eos_token_id": [12, 14], "pad_token_id": 13}
    source = _hf_folder(tmp_path / "src", family, ids, generation)
    folder, notes = export_checkpoint_hf(f"hf:{source}", tmp_path / "out")
    assert folder == source and notes == ()
    assert _ids(tmp_path / "out", "config.json") == ids
    assert _ids(tmp_path / "out", "generation_config.json") == generation
    _assert_loads_alike(source, tmp_path / "out")


def test_a_tokenizer_token_past_the_vocabulary_is_never_written(tmp_path):
    """The Qwen2 case: the tokenizer's <|endoftext|> is id vocab_size; the export used to write it as
    pad/bos/eos, and transformers refused the folder ("Padding_idx must be within num_embeddings")."""
    ids = {"bos_token_id": 11, "eos_token_id": 12, "pad_token_id": None}
    source = _hf_folder(tmp_path / "src", "qwen2", ids, added_eos="<|endoftext|>")
    assert PreTrainedTokenizerFast.from_pretrained(source).eos_token_id == VOCAB
    _, notes = export_checkpoint_hf(f"hf:{source}", tmp_path / "out")
    assert notes == ()
    for file in ("config.json", "generation_config.json"):
        assert _ids(tmp_path / "out", file) == ids, file
    _assert_loads_alike(source, tmp_path / "out")


def test_an_id_outside_the_vocabulary_in_the_source_is_left_out_with_a_note(tmp_path):
    """GPT2Config's defaults (bos/eos 50256) on a 96-token model, and a hand-edited pad id: neither
    can be embedded, so neither is written; each is named in a note and in suite_export.json."""
    source = _hf_folder(tmp_path / "src", "gpt2", {"pad_token_id": 3})
    config = json.loads((source / "config.json").read_text())
    assert config["eos_token_id"] == 50256
    config["pad_token_id"] = VOCAB
    (source / "config.json").write_text(json.dumps(config))
    _, notes = export_checkpoint_hf(f"hf:{source}", tmp_path / "out")
    assert _ids(tmp_path / "out", "config.json") == dict.fromkeys(KEYS)
    assert any("config.json eos_token_id=50256 is outside" in n for n in notes), notes
    assert any(f"config.json pad_token_id={VOCAB} is outside" in n for n in notes), notes
    marker = json.loads((tmp_path / "out" / "suite_export.json").read_text())
    assert marker["special_ids_left_out"] == list(notes)
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_a_suite_model_writes_its_tokenizer_ids_only_inside_the_vocabulary(tmp_path):
    cfg = ModelConfig(
        family="llama", num_layers=1, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_seq_len=64
    )
    model = materialize(build_model(cfg), "cpu", seed=0)
    export_hf(model, cfg, tmp_path / "in", _tokenizer())
    # the tokenizer's own bos (<s>, 1), not its eos: a run made from an imported model keeps the model's
    assert _ids(tmp_path / "in", "config.json") == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    export_hf(model, cfg, tmp_path / "past", _tokenizer(added_eos="<|endoftext|>"))
    for file in ("config.json", "generation_config.json"):
        assert _ids(tmp_path / "past", file) == {
            "bos_token_id": 1,
            "eos_token_id": None,
            "pad_token_id": None,
        }, file


def test_the_self_check_refuses_a_folder_transformers_would_not_load(tmp_path):
    source = _hf_folder(tmp_path / "src", "qwen2", {"eos_token_id": 12})
    verify_hf_folder(source, VOCAB)
    verify_hf_folder(source, VOCAB, load_bytes=0)  # large models: built on the meta device only
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "pad_token_id": VOCAB}))
    with pytest.raises(ExportCheckFailed, match=f"pad_token_id={VOCAB} \\(vocab_size {VOCAB}\\)"):
        verify_hf_folder(source, VOCAB)
    (source / "config.json").write_text(json.dumps(config))
    weights = load_file(source / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, source / "model.safetensors")
    with pytest.raises(ExportCheckFailed, match="missing_keys.*model.norm.weight"):
        verify_hf_folder(source, VOCAB)


def test_suite_export_says_which_ids_it_left_out(tmp_path, capsys):
    from suite.cli import main

    source = _hf_folder(tmp_path / "src", "gpt2", {"pad_token_id": 3})  # bos/eos: GPT2Config's 50256
    assert main(["export", f"ckpt=hf:{source}", f"out={tmp_path / 'out'}"]) == 0
    err = capsys.readouterr().err
    assert "note: config.json eos_token_id=50256 is outside the model's vocabulary (vocab_size 96)" in err
    assert _ids(tmp_path / "out", "config.json") == {
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 3,
    }
