"""`suite export format=hf` of a `suite quantize` checkpoint: a folder whose config.json records
transformers' TorchAoConfig, which `AutoModelForCausalLM.from_pretrained` loads quantized.

A tiny Llama (grouped-query attention) is pretrained for 20 steps by the CLI, then quantized with
each CPU method and exported in-process through the CLI's entry point. The exported model's linear
weights must be the checkpoint's own torchao tensors (the same integers, scales and zero points,
compared inner tensor by inner tensor) and its loss on held-out windows the suite's to 3
significant digits (relative difference below 5e-4; measured on 4 x 32 held-out tokens, loss
~4.40: equal for int8, int4 and gptq, 2e-6 relative for w8a8 and 1e-7 for smoothquant, whose
per-token activation rounding sees the float differences of transformers' norm and attention code). GPT-2 cannot hold them (Conv1D layers,
which TorchAoConfig does not quantize): one line, exit 2 (tests/e2e/test_quantize.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.e2e.test_quantize import _held_out_tokens
from tests.helpers import TINY_MODEL, run_suite

# method -> the torchao tensor type transformers must load on the quantized linear weights
METHODS = {
    "int8": "Int8Tensor",
    "w8a8": "Int8Tensor",
    "int4": "IntxUnpackedToInt8Tensor",
    "gptq": "IntxUnpackedToInt8Tensor",
    "smoothquant": "Int8Tensor",
}
FAST = ["compress.eval_batches=2", "compress.decode_tokens=8", "compress.calib_samples=8"]
LLAMA = ["model=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("qhf") / "llama"
    run_suite(
        "pretrain",
        *LLAMA,
        *TINY_MODEL,
        f"data.path={tiny_data}",
        f"run.dir={run}",
        "train.max_steps=20",
        "train.save_every=20",
        "train.eval_every=20",
        "parallel.micro_batch_size=8",
        "parallel.global_batch_size=8",
        "optim.lr=3e-3",
        check=True,
    )
    return run


@pytest.fixture(scope="module")
def exported(base_run) -> dict[str, tuple[Path, Path]]:
    """method -> (quantized run, exported HF folder)."""
    from suite.cli import main

    out = {}
    for method in METHODS:
        qrun, hf = base_run.parent / method, base_run.parent / f"{method}-hf"
        assert main(["quantize", f"ckpt={base_run}", f"compress={method}", f"run.dir={qrun}", *FAST]) == 0
        assert main(["export", f"ckpt={qrun}", f"out={hf}"]) == 0
        out[method] = (qrun, hf)
    return out


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()))


@pytest.mark.parametrize("method", METHODS)
def test_quantized_hf_folder_loads_quantized_with_the_same_loss(base_run, exported, method):
    from transformers import AutoModelForCausalLM

    from suite.infer.generate import load_for_inference

    qrun, hf = exported[method]
    config = json.loads((hf / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    layer = model.model.layers[0]
    for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
        assert type(linear.weight).__name__ == METHODS[method], type(linear.weight)
    assert type(model.lm_head.weight) in (torch.Tensor, torch.nn.Parameter)  # compress.skip: output
    ours, _, _ = load_for_inference(qrun, packed=False)  # the stored tensors the export holds
    tokens = _held_out_tokens(base_run)[:4]
    with torch.no_grad():
        suite_loss, hf_loss = _loss(ours(tokens), tokens), _loss(model(tokens).logits, tokens)
    assert abs(hf_loss - suite_loss) <= 5e-4 * suite_loss, (method, suite_loss, hf_loss)
    manifest = json.loads((hf / "export_manifest.json").read_text())
    assert manifest["format"] == "hf" and manifest["precision"] == f"torchao {method}"
    assert manifest["verification"]["quantized_tensors_identical"] == 14  # 7 linears x 2 layers
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" in manifest["tokenizer_files"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_exported_tensors_are_the_checkpoints(exported, method):
    """Same integers, scales and zero points: nothing was quantized again."""
    from transformers import AutoModelForCausalLM

    from suite.models.quantized import read_quantized_state

    qrun, hf = exported[method]
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    ours = read_quantized_state(next((qrun / "checkpoints").glob("step_*")))
    pairs = {
        "layers.1.attention.wk.weight": model.model.layers[1].self_attn.k_proj.weight,
        "layers.0.feed_forward.w3.weight": model.model.layers[0].mlp.up_proj.weight,
    }
    for name, theirs in pairs.items():
        inner, _ = ours[name].__tensor_flatten__()
        assert inner and all(torch.equal(getattr(ours[name], n), getattr(theirs, n)) for n in inner), name
