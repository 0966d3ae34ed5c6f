"""`suite export format=torch_export|onnx`: the prefill and decode graphs (suite.infer.graphs) as
`.pt2` programs or ONNX models, the tokenizer beside them, a manifest, and a self-check.

ONNX variants: `export.quantize=int8` runs onnxruntime's dynamic quantization (int8 weights, int8
activations quantized per call: MatMulInteger), `int4` its block-wise weight-only quantization
(MatMulNBits, blocks of 32, symmetric), the portable low-bit CPU path torchao does not give on x86.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from suite.config.errors import ConfigError
from suite.export.checks import MARKER
from suite.export.manifest import write_manifest
from suite.infer.graphs import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    dynamic_shapes,
    example_inputs,
    export_programs,
    graph_modules,
    prepare_for_export,
    traceable_moe,
)
from suite.infer.runners import SuiteRunner, decode_steps, load_runner
from suite.model_source import ModelSource
from suite.models.transformer import Transformer
from suite.runtime import DTYPES

ONNX_QUANTIZE = ("int8", "int4")
INT4_BLOCK = 32


def save_torch_export(model: Transformer, out: Path) -> list[str]:
    files = []
    for name, program in export_programs(model).items():
        torch.export.save(program, str(out / f"{name}.pt2"))
        files.append(f"{name}.pt2")
    return files


@torch.no_grad()
def save_onnx(model: Transformer, out: Path, quantize: str | None = None) -> list[str]:
    """Both graphs through the dynamo ONNX exporter; weights over 2 GB go to external data files."""
    prepare_for_export(model)
    inputs, shapes = example_inputs(model), dynamic_shapes(model)
    files = []
    for name, module in graph_modules(model).items():
        path = out / f"{name}.onnx"
        with _quiet_exporter(), traceable_moe(model):
            program = torch.onnx.export(
                module,
                inputs[name],
                dynamo=True,
                dynamic_shapes=shapes[name],
                input_names=INPUT_NAMES[name],
                output_names=OUTPUT_NAMES,
                verbose=False,
            )
        big = sum(p.numel() * p.element_size() for p in model.parameters()) > 1.8 * 2**30
        program.save(str(path), external_data=big)
        if quantize:
            quantize_onnx(path, quantize)
        files += sorted(p.name for p in out.glob(f"{name}.onnx*"))
    return files


def quantize_onnx(path: Path, method: str) -> None:
    """Rewrite `path` in place with onnxruntime's int8 (dynamic) or int4 (MatMulNBits) quantization."""
    # deferred: onnx and onnxruntime are optional (the deploy extra); only export.quantize of an ONNX export needs them
    import onnx

    with tempfile.TemporaryDirectory(prefix="suite-onnx-q-") as tmp:
        target = Path(tmp) / path.name
        if method == "int8":
            # deferred: onnxruntime is optional (the deploy extra), as above
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(path), str(target), weight_type=QuantType.QInt8)
        else:
            # deferred: onnxruntime is optional (the deploy extra), as above
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), block_size=INT4_BLOCK, is_symmetric=True)
            quantizer.process()
            quantizer.model.save_model_to_file(str(target), use_external_data_format=False)
        for stale in path.parent.glob(f"{path.name}*"):
            stale.unlink()
        shutil.move(str(target), str(path))
        for extra in Path(tmp).glob(f"{path.name}.*"):
            shutil.move(str(extra), str(path.parent / extra.name))


class _quiet_exporter:
    """The ONNX exporter's progress lines and torchvision notes are noise on a user's console."""

    def __enter__(self):
        self._level = logging.getLogger("torch.onnx").level
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        logging.getLogger("torch.onnx").setLevel(self._level)
        return False


def check_graph_export(fmt: str, quantize: str | None, dtype: str, source: ModelSource) -> None:
    """What torch_export / onnx can hold, refused in one line before anything is written."""
    if source.quantized:
        raise ConfigError(
            f"{source.named} is a `suite quantize` checkpoint; format={fmt} holds float weights only: export the "
            "float checkpoint it came from"
            + (" with export.quantize=int8 or int4 (onnxruntime's own quantization)" if fmt == "onnx" else "")
            + ", or format=hf for the quantized weights"
        )
    if quantize is not None and (fmt != "onnx" or quantize not in ONNX_QUANTIZE):
        holds = {"onnx": "int8 or int4", "torch_export": "none (float programs)"}.get(fmt, "")
        raise ConfigError(f"export.quantize={quantize} with format={fmt}: format={fmt} holds {holds}")
    if fmt == "onnx" and dtype != "fp32":
        raise ConfigError(
            f"export.dtype={dtype} with format=onnx: the ONNX export is fp32 (export.quantize=int8|int4 "
            "makes it smaller); use format=torch_export for bf16/fp16 programs"
        )


def verify_graphs(model: Transformer, out: Path, batch: int = 2, seq: int = 8, steps: int = 4) -> dict:
    """The written artifact against the suite model: max |logits difference| of the prefill and of
    `steps` greedy decode steps through the cache, and whether the greedy tokens agree."""
    runner, _ = load_runner(out)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=generator)
    expected = decode_steps(SuiteRunner(model), tokens, steps)
    got = decode_steps(runner, tokens, steps)
    errors = [float((a.float() - b.float()).abs().max()) for a, b in zip(expected, got)]
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(expected, got))
    return {
        "batch": batch,
        "prompt_tokens": seq,
        "decode_steps": steps,
        "prefill_max_abs_error": errors[0],
        "decode_max_abs_error": max(errors[1:]) if steps else 0.0,
        "greedy_tokens_equal": same,
    }


def export_graphs(
    source: ModelSource, out: Path, fmt: str, dtype: str = "fp32", quantize: str | None = None
) -> dict:
    """Write the `fmt` artifact of `source` into `out` with its tokenizer and manifest, then run it
    against the suite model. Returns the manifest."""
    tokenizer = source.tokenizer(required=True)
    model = source.load_model("cpu", DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.pt2"), *out.glob("*.onnx"), *out.glob("*.onnx.data")]:
        stale.unlink()
    files = save_torch_export(model, out) if fmt == "torch_export" else save_onnx(model, out, quantize)
    files += [Path(name).name for name in tokenizer.save_pretrained(out)]
    marker = {"family": model.cfg.family, "name": model.cfg.name, "format": fmt}
    (out / MARKER).write_text(json.dumps(marker, indent=1))  # the folder may be exported into again
    fields = {"format": fmt, "precision": quantize or dtype, "source": source, "files": files}
    extra = {"graphs": GRAPH_SIGNATURES}
    write_manifest(out, **fields, verification={}, extra=extra)  # the runner reads it
    path = write_manifest(out, **fields, verification=verify_graphs(model, out), extra=extra)
    return json.loads(path.read_text())


GRAPH_SIGNATURES = {
    "prefill": "tokens [batch, seq] int64 -> logits [batch, seq, vocab], keys, values",
    "decode": "tokens [batch, 1], past_keys, past_values -> logits [batch, 1, vocab], keys, values",
    "cache": "keys/values [layers, batch, kv_heads, length, head_dim]; decode returns length + 1",
}
