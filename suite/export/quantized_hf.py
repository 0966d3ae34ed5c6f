"""`suite export format=hf` of a `suite quantize` checkpoint: a folder transformers loads quantized.

config.json carries transformers' TorchAoConfig (`quantization_config`) with the torchao config the
suite's method used (its class in suite.models.compression), and model.safetensors holds the suite's own torchao
tensors under the HF names, flattened the way transformers' torchao quantizer saves them
(torchao.prototype.safetensors: each tensor subclass's inner tensors + a JSON description in the
file's metadata). Nothing is quantized again: `from_pretrained` rebuilds the very tensors (same
integers, same scales; the export checks that), and the logits match the suite's quantized model.

What the HF side cannot express is refused in one line: GPT-2's transformers class computes with
Conv1D layers, which TorchAoConfig does not quantize (nn.Linear only); a method whose `formats` lack
"hf" (int4-tinygemm's CUDA tensors); a quantized output head (transformers keeps lm_head in float unless embeddings are
quantized too); fused projections and MoE experts (no per-projection tensor to rename).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from suite.config.errors import ConfigError
from suite.config.schema import CompressConfig
from suite.export.manifest import max_logits_error, quiet_loading, sample_tokens, write_manifest
from suite.export.special import in_vocabulary, tokenizer_ids
from suite.infer.generate import load_for_inference
from suite.models.compression import HF, exporting, post_training
from suite.models.family import family_of
from suite.models.hf_mapping import hf_config, to_hf_state_dict
from suite.models.quantized import is_quantized_tensor, quantized_info, quiet_torchao, read_quantized_state


def check_quantized_hf(source: Any, info: dict[str, Any]) -> None:
    """One line for what config.json's TorchAoConfig + transformers' classes cannot hold."""
    method = info.get("method", "?")
    cfg = source.model_config()
    where = f"{source.named} ({method})"
    stored = post_training(method)
    if stored is None or HF not in stored.formats:
        raise ConfigError(
            f"{where}: no Hugging Face TorchAoConfig expresses compress={method} on this machine; the quantized "
            f"methods that export to format=hf: {', '.join(exporting(HF))}"
        )
    problem = None
    if family_of(cfg).hf.quantized_problem:
        problem = family_of(cfg).hf.quantized_problem
    elif cfg.num_experts or cfg.fused_projections:
        problem = "its quantized experts / fused projections have no per-projection HF tensor"
    elif "output" in info.get("quantized", []):
        problem = "its output head is quantized, which transformers keeps in float (compress.skip holds output by default)"
    if problem:
        raise ConfigError(
            f"{where} cannot be exported quantized to format=hf: {problem}; export the full-precision "
            f"{info.get('source', 'source')} (format=hf, or format=gguf export.quantize=q8_0)"
        )


def torchao_quant_type(info: dict[str, Any], group_size: int, symmetric: bool = True) -> Any:
    """The torchao config of the checkpoint's tensors (the CPU layout): what TorchAoConfig records and
    loads with. `symmetric`: whether its int4 tensors' zero points are all 0 (compress.symmetric)."""
    method = info["method"]
    compress = CompressConfig(method=method, group_size=group_size, symmetric=symmetric)
    return post_training(method).torchao_config(compress, torch.device("cpu"))


def write_quantized_hf(source: Any, out: Path) -> list[str]:
    """Write the folder; returns the files written (relative to `out`)."""
    # torchao and transformers: heavy optional dependencies, imported when a quantized export runs
    # deferred: transformers (~2 s) and torchao's safetensors support loads only when an HF folder is written or read back
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from transformers import GenerationConfig, TorchAoConfig

    quiet_torchao()
    info = quantized_info(source.folder)
    check_quantized_hf(source, info)
    cfg = source.model_config()
    saved = source.saved
    group_size = saved.compress.group_size if saved is not None else 32
    tokenizer = source.tokenizer()
    ids = tokenizer_ids(tokenizer)
    special = in_vocabulary(ids, ids, cfg.vocab_size)
    state = read_quantized_state(source.folder)
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    hf_sd = to_hf_state_dict(cfg, state)
    if cfg.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)
    config = hf_config(cfg)
    config.update(special.config)
    config.dtype = torch.float32
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    symmetric = not any(
        getattr(t, "zero_point", None) is not None and t.zero_point.any() for t in state.values()
    )
    quant_type = torchao_quant_type(info, group_size, symmetric)
    quant = TorchAoConfig(quant_type=quant_type, modules_to_not_convert=["lm_head"])
    config.quantization_config = quant.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    data, metadata = flatten_tensor_state_dict(hf_sd)
    save_file(
        {k: v.detach().contiguous() for k, v in data.items()},
        str(out / "model.safetensors"),
        metadata={**(metadata or {}), "format": "pt"},
    )
    config.save_pretrained(out)
    GenerationConfig(**special.generation).save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"family": cfg.family, "name": cfg.name, "quantized": info["method"]}
    (out / "suite_export.json").write_text(json.dumps(marker, indent=1))
    return sorted(p.name for p in out.iterdir() if p.is_file())


def same_tensors(hf_model: Any, source: Any) -> tuple[int, list[str]]:
    """(quantized tensors compared, names whose inner tensors differ): the loaded HF model's torchao
    tensors against the checkpoint's, inner tensor by inner tensor (integers, scales, zero points)."""

    cfg = source.model_config()
    state = read_quantized_state(source.folder)
    if cfg.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    ours = to_hf_state_dict(cfg, state)
    theirs = dict(hf_model.state_dict())
    compared, differ = 0, []
    for name, tensor in ours.items():
        if not is_quantized_tensor(tensor):
            continue
        compared += 1
        other = theirs.get(name)
        if other is None or type(other) is not type(tensor):
            differ.append(name)
            continue
        inner, _ = tensor.__tensor_flatten__()
        if not all(torch.equal(getattr(tensor, n), getattr(other, n)) for n in inner):
            differ.append(name)
    return compared, differ


def verify_quantized_hf(out: Path, source: Any) -> dict[str, Any]:
    """Load the folder as a user does and compare with the suite's quantized model."""
    # transformers: a heavy optional dependency, imported when a quantized export runs
    # deferred: transformers (~2 s) loads only when an HF folder is written or read back
    from transformers import AutoModelForCausalLM

    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(out).eval()
    compared, differ = same_tensors(model, source)
    if differ or not compared:
        raise RuntimeError(
            f"{out}: transformers loads quantized tensors that differ from the checkpoint's: {differ[:3]}"
        )
    suite_model, _, _ = load_for_inference(source, packed=False)  # the stored tensors, as exported
    tokens = sample_tokens(source.model_config())
    return {
        "max_abs_logits_error": max_logits_error(suite_model, model, tokens),
        "inputs": f"{tokens.shape[0]} x {tokens.shape[1]} seeded random tokens",
        "loaded_with": "transformers.AutoModelForCausalLM.from_pretrained(out)",
        "quantized_tensors_identical": compared,
    }


def export_quantized_hf(source: Any, out: Path) -> tuple[Path, dict[str, Any]]:
    """`suite export format=hf` of a quantized checkpoint: folder, self-check, manifest."""

    info = quantized_info(source.folder)
    files = write_quantized_hf(source, out)
    verification = verify_quantized_hf(out, source)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    write_manifest(
        out,
        format="hf",
        precision=f"torchao {info['method']}",
        source=source,
        files=files,
        verification=verification,
        extra={"quantization_config": quant, "quantized_modules": len(info.get("quantized", []))},
    )
    return out, verification
