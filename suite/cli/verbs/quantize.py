"""`suite quantize`: post-training quantization of a checkpoint, with a before/after report."""

from __future__ import annotations

from suite.cli.common import _compose_with_ckpt, _explicit_dir, _report_compression
from suite.folders import OVERWRITE
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.compress.checks import check_compress_option

    check_compress_option(overrides)  # a method that is not built yet: named before composing
    cfg, _ = _compose_with_ckpt(overrides, "runs/gpt-tiny compress=int8")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.compress.quantize import run_quantize

    report = run_quantize(cfg, _explicit_dir(overrides))
    return _report_compression(report, report["method"], flags)


HELP = """usage: suite quantize ckpt=<run.dir|checkpoint dir|hf:folder|gguf:file> compress={compress_names} [run.dir=OUT]
       [compress.group_size=32] ['compress.skip=[tok_embeddings, pos_embeddings, output]'] [--json]

Post-training quantization of the Linear layers with torchao, measured before and after on the
recipe's held-out data (an hf:/gguf: source: data.path, data.sources or the embedded corpus, in
its own tokenizer; SmoothQuant and GPTQ calibrate on the same). compress= picks a recipes/compress option (compress.method):
{compress_methods}
Keys: compress.group_size  compress.skip (module-name patterns kept in full precision)
      compress.embedding=int8 (the token embedding and a head tied to it as int8 rows; default none)
      compress.calib_samples  compress.smoothquant_alpha  compress.gptq_damp
      gptq: compress.symmetric  compress.clip_search  compress.clip_weighted  compress.act_order
            compress.int8_layers (docs/compression.md)
      compress.eval_batches  compress.decode_tokens
      compress.task_samples (held-out questions scored when the run was finetuned on a built-in task)
      run.dir (default <ckpt run>-<method>)  train.device=auto|cpu|cuda

Writes: <run.dir>/checkpoints/step_<N>/ (model.safetensors with torchao's quantized tensors,
quantized.json), config.yaml (with compress), the tokenizer, report.json (parameters, bytes on disk,
held-out perplexity, task exact match for a finetuned run, decode tokens/s, before and after).
`suite generate` and `suite eval` take the folder as ckpt=, `suite finetune finetune.method=lora` as
model.init_from= (LoRA over the int weights: int8, int4, gptq). See docs/compression.md.

Examples:
  suite quantize ckpt=runs/gpt-tiny compress=int8
  suite quantize ckpt=runs/gpt-tiny compress=int4 compress.group_size=64 run.dir=runs/gpt-tiny-int4-g64
  suite quantize ckpt=runs/gpt-tiny compress=gptq run.dir=runs/gpt-tiny-gptq
  suite finetune recipe=sft-tiny-lora model.init_from=runs/gpt-tiny-gptq run.dir=runs/qlora"""


VERB = register(
    Verb(
        name="quantize",
        summary="post-training quantization with a before/after report: suite quantize ckpt=<run.dir> compress=int8",
        help=HELP,  # {compress_methods} and {compress_names} filled in when shown (suite.cli.help)
        run=run,
        unused=("export", "prune", "distill", "optim", "sched", "recompute", "cluster", "eval", "align"),
        section="compress",
        flags=(OVERWRITE,),
        composes=True,
        stage_output="checkpoint",
        output_key="run.dir",
    )
)
