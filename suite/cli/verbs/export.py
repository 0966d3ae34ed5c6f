"""`suite export`: a Hugging Face folder, torch.export / ONNX graphs or a GGUF file from a checkpoint."""

from __future__ import annotations

from pathlib import Path

from suite.cli.common import _compose_with_ckpt, _report, _say
from suite.config.errors import ConfigError
from suite.export.checks import record_export
from suite.folders import OVERWRITE
from suite.preflight import validate
from suite.runtime import DTYPES
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    cfg, source = _compose_with_ckpt(overrides, "runs/gpt-tiny")
    fmt = cfg.export.format
    validate(cfg, needs_data=False, writes_run=False)
    if fmt in ("torch_export", "onnx"):
        return _export_graphs(cfg, source, flags)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.gguf_cli import export_gguf_or_quantized_hf

    exported = export_gguf_or_quantized_hf(
        cfg, source
    )  # format=gguf; format=hf of a `suite quantize` checkpoint
    if exported is not None:
        record_export(cfg, source, Path(exported[0]["out"]))
        return _report(flags, *exported, source)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.compress.checks import refuse_quantized

    refuse_quantized(cfg.ckpt, "ckpt", "exporting")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.checks import check_export_out, check_hf_exportable, export_out

    check_export_out(cfg.export.out)
    check_hf_exportable(source.model_config())
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.hf import export_checkpoint_hf

    if source.lora is not None and not cfg.export.merge_lora:
        raise ConfigError(
            f"ckpt='{cfg.ckpt}' was finetuned with LoRA; pass merge_lora=true to fold the adapters into the "
            "exported weights (the adapters alone are in <run.dir>/lora/)"
        )
    dtype = DTYPES[cfg.export.dtype]
    if cfg.export.max_shard_mb <= 0:
        raise ConfigError(f"export.max_shard_mb={cfg.export.max_shard_mb} must be > 0; e.g. 2048")
    out = export_out(cfg, source)
    shard_bytes = int(cfg.export.max_shard_mb * 2**20)
    # streamed tensor by tensor from the checkpoint files: never the whole model in memory
    folder, notes = export_checkpoint_hf(source, out, dtype, shard_bytes)
    for note in notes:  # an id the model cannot embed is left out rather than written
        _say(f"note: {note}")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.gguf_cli import hf_manifest

    check = hf_manifest(source, out, dtype, shard_bytes)  # export_manifest.json, with the logits self-check
    lines = [f"exported {folder} to {out} (load with transformers.AutoModelForCausalLM.from_pretrained)"]
    if check["max_abs_logits_error"] is not None:
        lines.append(
            f"self-check: max |logits - suite| = {check['max_abs_logits_error']:.3g} on {check['inputs']}"
        )
    lines.append(f"manifest: {out / 'export_manifest.json'}")
    record_export(cfg, source, out)
    return _report(flags, {"out": str(out), "format": cfg.export.format, **check}, "\n".join(lines), source)


def _export_graphs(cfg, source, flags: set[str]) -> int:
    """format=torch_export|onnx: prefill + decode graphs with an explicit KV cache (suite.export.programs)."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.export.checks import export_out
    from suite.export.programs import check_graph_export, export_graphs

    fmt = cfg.export.format
    check_graph_export(fmt, cfg.export.quantize, cfg.export.dtype, source)
    if source.lora is not None and not cfg.export.merge_lora:
        raise ConfigError(
            f"ckpt='{cfg.ckpt}' was finetuned with LoRA; pass merge_lora=true to fold the adapters into the "
            "exported weights (the adapters alone are in <run.dir>/lora/)"
        )
    out = export_out(cfg, source)
    _say(f"exporting {fmt} prefill and decode graphs to {out} ...")
    manifest = export_graphs(source, out, fmt, cfg.export.dtype, cfg.export.quantize)
    check = manifest["verification"]
    runner = {"torch_export": "torch.export.load(...).module()", "onnx": "onnxruntime.InferenceSession"}[fmt]
    text = (
        f"exported {source.folder} to {out} as {fmt} ({manifest['precision']}; {', '.join(manifest['files'])}; "
        f"run with {runner} or suite generate ckpt={out})\n"
        f"self-check against the suite model: prefill logits max |error| {check['prefill_max_abs_error']:.2e}, "
        f"{check['decode_steps']} decode steps {check['decode_max_abs_error']:.2e}, greedy tokens "
        f"{'equal' if check['greedy_tokens_equal'] else 'DIFFER'} (recorded in {out}/export_manifest.json)"
    )
    record_export(cfg, source, out)
    return _report(flags, {"out": str(out), **manifest}, text, source)


HELP = """usage: suite export ckpt=<run.dir|checkpoint dir|hf:folder> [format=hf|torch_export|onnx|gguf] [out=DIR]
       [export.dtype=fp32|bf16|fp16] [export.quantize=int8|int4 (onnx)|f16|q8_0|q4_0 (gguf)] [merge_lora=true]
       [export.max_shard_mb=2048]

format=hf (default) writes a Hugging Face folder (safetensors, config.json, generation_config.json,
tokenizer files) that transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained load with no
custom code: gpt models as GPT-2, llama-family models as Llama (Qwen2 when they use qkv bias).
format=torch_export writes prefill.pt2 and decode.pt2 (torch.export programs); format=onnx the same two
graphs as prefill.onnx / decode.onnx for onnxruntime, fp32, or with export.quantize=int8 (onnxruntime
dynamic quantization) or int4 (block-wise MatMulNBits, blocks of 32). Both graphs carry the KV cache
explicitly ([layers, batch, kv heads, length, head_dim]; dynamic batch, prompt and past lengths):
prefill(tokens) -> logits, keys, values; decode(tokens [b, 1], past_keys, past_values) -> the same.
`suite generate ckpt=<that folder>` runs them.
`format=` and `out=` are short for export.format and export.out (default <run.dir>/export-<format>).
A LoRA finetuning run needs merge_lora=true (export.merge_lora): the adapters are folded into the
weights. A run finetuned with a chat template exports it (chat_template.jinja).
format=hf reads the checkpoint (any parallel layout wrote it) one tensor at a time, never the whole model;
export.max_shard_mb=N splits the weights into safetensors files of at most N MB (+ an index).
`out=` must be a new or empty folder, or an earlier export (it is never mixed into other files).
Special-token ids are the source's (an hf: folder's config.json); one outside the vocabulary is left
out with a note. The written folder is checked: transformers loads it.
format=gguf writes one llama.cpp file (gpt2 / llama architecture, byte-level BPE tokenizer) at
export.quantize=f16 (default), q8_0 or q4_0; norms and biases stay F32.
A `suite quantize` checkpoint (llama family) exports as an HF folder that transformers loads
quantized (TorchAoConfig in config.json, the checkpoint's own torchao tensors).
Every export writes export_manifest.json (format, precision, files, tokenizer, source checkpoint and
step, config hash) and prints its self-check: the largest |logits - suite| of the artifact as a user
runs it (transformers, torch.export, onnxruntime), also recorded there. See docs/export.md.

Examples:
  suite export ckpt=runs/gpt-tiny
  suite export ckpt=runs/gpt-tiny out=exports/gpt-tiny-bf16 export.dtype=bf16 export.max_shard_mb=1
  suite export ckpt=runs/gpt-tiny format=onnx export.quantize=int8 out=exports/gpt-tiny-onnx-int8
  suite generate ckpt=exports/gpt-tiny-onnx-int8 prompt="The module" generate.temperature=0
  suite export ckpt=runs/gpt-tiny format=gguf export.quantize=q8_0 out=exports/gpt-tiny-gguf"""


VERB = register(
    Verb(
        name="export",
        summary="write a Hugging Face folder, torch.export/ONNX graphs or GGUF: suite export ckpt=<run.dir> format=onnx",
        help=HELP,
        run=run,
        unused=("generate", "prune", "distill", "optim", "sched", "recompute", "cluster", "eval", "align"),
        section="use",
        flags=(OVERWRITE,),
        composes=True,
        stage_output="files",
        output_key="export.out",
    )
)
