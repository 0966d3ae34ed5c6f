"""`suite export format=gguf`: one llama.cpp GGUF file (f16, q8_0 or q4_0) + export_manifest.json.

The tensors start from the Hugging Face names and layout (suite.models.hf_mapping's to_hf_state_dict, as
llama.cpp's convert_hf_to_gguf.py starts from an HF folder) and are renamed with gguf's own tensor
name map. The architecture, its hyper-parameter keys and the layout changes are the family's
(`Family.gguf`): GPT-2's Conv1D weights ([in, out]) are stored as [out, in], and Llama's q/k rows are
permuted from HF's rotate-half RoPE order to llama.cpp's interleaved pairs (transformers' GGUF loader
undoes both); Qwen3 keeps rotate-half (llama.cpp's NeoX RoPE), so its q/k are stored as they are.
Layouts of a family's own go through `GGUFMapping.tensors`: stacked experts as ffn_*_exps (qwen3moe,
deepseek2), MLA's kv_b split per head into k_b / v_b (deepseek2).

Which tensors stay float follows llama.cpp: 1-D tensors (norms, biases), the learned position
embedding and the MoE routers (ffn_gate_inp) F32; the output head of a q4_0 file Q8_0 (llama-quantize raises it to Q6_K, which the
gguf package cannot write for small rows); a matrix whose rows are not a multiple of the 32-value
quantization block F16, named in the manifest. What GGUF or transformers' GGUF reader cannot
express is refused in one line (check_gguf_exportable). GGUFWriter holds the (quantized) tensors
until the file is written: the model once, at the file's precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from suite.config.errors import ConfigError
from suite.config.schema import ModelConfig
from suite.export.checks import check_hf_exportable
from suite.export.gguf_vocab import add_vocab, chat_template_of, gguf_vocab, source_pre
from suite.export.manifest import max_logits_error, quiet_loading, sample_tokens, write_manifest
from suite.export.special import imported_ids, in_vocabulary, tokenizer_ids
from suite.models.family import family_of
from suite.models.hf_mapping import to_hf_state_dict
from suite.models.lazy import as_lazy
from suite.models.quantized import quantized_info
from suite.models.transformer import ffn_size, kv_heads

PRECISIONS = ("f16", "q8_0", "q4_0")
BLOCK = 32  # values per Q8_0 / Q4_0 block
# llama.cpp keeps the learned positions F32, and the MoE router (a rounded router picks other experts)
KEEP_F32 = ("position_embd.weight", "ffn_gate_inp.weight")


def gguf_precision(quantize: str | None) -> str:
    """export.quantize for format=gguf (None: f16); a ConfigError for what GGUF cannot hold here."""
    value = "f16" if quantize is None else str(quantize).lower()
    if value not in PRECISIONS:
        raise ConfigError(
            f"export.quantize={quantize} cannot be written as GGUF: format=gguf holds {', '.join(PRECISIONS)} "
            "(e.g. export.quantize=q8_0); torchao int8/int4 are format=hf of a `suite quantize` checkpoint"
        )
    return value


def check_gguf_exportable(cfg: ModelConfig, where: str) -> None:
    """What the family's llama.cpp architecture and transformers' GGUF reader can express."""
    check_hf_exportable(cfg)
    mapping = family_of(cfg).gguf
    problem = f"llama.cpp has no architecture for the {cfg.family} family here" if mapping is None else None
    problem = problem or mapping.problem(cfg)
    if problem:
        raise ConfigError(f"{where} cannot be exported as GGUF: {problem}; use format=hf")


def refuse_quantized_source(source: Any) -> None:
    """A `suite quantize` checkpoint: its torchao integers are not GGUF's blocks; name its source."""
    if not source.quantized:
        return
    info = quantized_info(source.folder)
    method, base = info.get("method", "?"), info.get("source", "<the full-precision run>")
    raise ConfigError(
        f"{source.named} is a `suite quantize` checkpoint ({method}); GGUF quantizes from full precision: "
        f"export ckpt={base} format=gguf export.quantize=q8_0 (or q4_0), or format=hf of this one"
    )


def gguf_tensor_type(name: str, array: np.ndarray, precision: str, head: str) -> tuple[Any, str | None]:
    """(GGML type, note) for one tensor: float where llama.cpp keeps it float, F16 where the row
    length is not a multiple of the block (the note says so)."""
    # deferred: gguf is optional (the deploy extra); only format=gguf needs it
    import gguf

    T = gguf.GGMLQuantizationType
    if array.ndim <= 1 or name.endswith(("_norm.weight", *KEEP_F32)):
        return T.F32, None
    if precision == "f16":
        return T.F16, None
    qtype = T.Q8_0 if precision == "q8_0" or name == head else T.Q4_0
    if array.shape[-1] % BLOCK:
        return T.F16, f"{name}: rows of {array.shape[-1]} values are not a multiple of {BLOCK}; kept F16"
    return qtype, None


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved rotary pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig, hf_sd: dict[str, Any]):
    """(gguf name, float32 array) per tensor, read one at a time from (lazy) HF-named tensors."""
    # deferred: gguf is optional (the deploy extra); only format=gguf needs it
    import gguf

    mapping = family_of(cfg).gguf
    arch = gguf.MODEL_ARCH[mapping.arch_of(cfg).upper()]
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    for hf_name, value in hf_sd.items():
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # tied: the reader uses token_embd (no output tensor means tied)
        own = mapping.tensors(cfg, hf_name, value)
        if own is not None:  # the family's layout change (stacked experts, MLA's kv_b per head)
            for name, tensor in own:
                yield name, tensor.float().contiguous().numpy()
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RuntimeError(f"no GGUF name for {hf_name}")
        tensor = as_lazy(value).read().float()
        if mapping.transposed and hf_name.endswith(mapping.transposed):
            tensor = tensor.t()
        elif mapping.permute_qk and hf_name.endswith("self_attn.q_proj.weight"):
            tensor = _permute(tensor, cfg.num_heads)
        elif mapping.permute_qk and hf_name.endswith("self_attn.k_proj.weight"):
            tensor = _permute(tensor, kv_heads(cfg))
        yield name, tensor.contiguous().numpy()


def add_hparams(writer: Any, cfg: ModelConfig) -> None:
    """The architecture keys llama.cpp reads (and transformers maps onto its config): the shared
    ones here, the family's own (norms, RoPE, head size) from its GGUFMapping."""
    writer.add_name(cfg.name)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(ffn_size(cfg))
    writer.add_head_count(cfg.num_heads)
    mapping = family_of(cfg).gguf
    writer.add_head_count_kv(mapping.kv_heads(cfg) if mapping.kv_heads else kv_heads(cfg))
    mapping.add_hparams(writer, cfg)


def write_gguf(source: Any, out: Path, precision: str) -> tuple[Path, dict[str, Any]]:
    """Write <out>/<name>-<precision>.gguf from a model source; returns (file, manifest extras)."""
    # deferred: gguf is optional (the deploy extra); only format=gguf needs it
    import gguf

    cfg = source.model_config()
    check_gguf_exportable(cfg, source.named)
    tokenizer = source.tokenizer(required=True)
    vocab = gguf_vocab(tokenizer, cfg.vocab_size, source.named)
    if source.gguf:
        vocab = source_pre(vocab, source.gguf_file.field("tokenizer.ggml.pre"))
    ids = imported_ids(source)[0] if source.is_hf else tokenizer_ids(tokenizer)
    special = in_vocabulary(ids, ids, cfg.vocab_size)
    arch = family_of(cfg).gguf.arch_of(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.gguf"):  # an earlier export into this folder (out= reuses one)
        stale.unlink()
    path = out / f"{cfg.name}-{precision}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    add_hparams(writer, cfg)
    file_type = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}[precision]
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    template = chat_template_of(tokenizer)
    add_vocab(writer, vocab, special.config, template)
    head = "token_embd.weight" if cfg.tie_embeddings else "output.weight"
    types: dict[str, str] = {}
    notes = list(vocab.notes) + list(special.notes)
    with source.weights() as weights:
        for name, array in gguf_tensors(cfg, to_hf_state_dict(cfg, dict(weights))):
            qtype, note = gguf_tensor_type(name, array, precision, head)
            if note:
                notes.append(note)
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, array.astype(np.float32))
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, array.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            types[name] = f"{qtype.name} {list(array.shape)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    extra = {
        "architecture": arch,
        "tensors": types,
        "tokenizer": {
            "model": "gpt2",
            "pre": vocab.pre,
            "tokens": len(vocab.tokens),
            "padded": vocab.padded,
            "chat_template": template is not None,
        },
        "notes": notes,
        "transformers_load_kwargs": {"gguf_file": path.name, **load_kwargs(cfg)},
    }
    return path, extra


def load_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """What `from_pretrained(out, gguf_file=...)` needs beside the file (the family says)."""
    return family_of(cfg).gguf.load_kwargs(cfg)


def verify_gguf(path: Path, suite_model: Any, cfg: ModelConfig) -> dict[str, Any]:
    """Load the file the way a user does (transformers dequantizes it to fp32) and compare logits;
    an architecture transformers' reader cannot rebuild (DeepSeek's deepseek2) is skipped, saying why."""
    mapping = family_of(cfg).gguf
    problem = mapping.unreadable(mapping.arch_of(cfg))
    if problem:
        return {"max_abs_logits_error": None, "skipped": problem}
    # deferred: transformers costs seconds to import; only the export's load check needs it
    from transformers import AutoModelForCausalLM

    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **load_kwargs(cfg)
        )
    tokens = sample_tokens(cfg)
    error = max_logits_error(suite_model, model.eval(), tokens)
    return {
        "max_abs_logits_error": error,
        "inputs": f"{tokens.shape[0]} x {tokens.shape[1]} seeded random tokens",
        "loaded_with": "transformers.AutoModelForCausalLM.from_pretrained(out, "
        + ", ".join([f"gguf_file='{path.name}'", *(f"{k}={v}" for k, v in load_kwargs(cfg).items())])
        + ")",
    }


def export_gguf(source: Any, out: Path, quantize: str | None) -> tuple[Path, dict[str, Any]]:
    """`suite export format=gguf`: the file, its self-check and export_manifest.json; returns
    (file, verification)."""
    precision = gguf_precision(quantize)
    refuse_quantized_source(source)
    path, extra = write_gguf(source, out, precision)
    verification = verify_gguf(path, source.load_model(), source.model_config())
    write_manifest(
        out,
        format="gguf",
        precision=precision,
        source=source,
        files=[path.name],
        verification=verification,
        extra=extra,
    )
    return path, verification
