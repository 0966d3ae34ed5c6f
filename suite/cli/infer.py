"""The verbs that read a trained model to use or ship it: generate, chat, export (suite.cli dispatches)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite.cli.common import _compose, _compose_with_ckpt, _report, _say
from suite.config.errors import ConfigError
from suite.config.validate import world_size
from suite.export.checks import record_export
from suite.infer.parallel_eval import RESULT
from suite.preflight import validate
from suite.runtime import DTYPES


def cmd_generate(overrides: list[str], flags: set[str]) -> int:
    from suite.infer.checks import check_generate, take_prompt

    overrides, prompt = take_prompt(overrides)  # verbatim: never through the override grammar
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError(
            "ckpt is missing; pass ckpt=<run.dir, checkpoint, hf:<folder>, or a suite export folder>, "
            "e.g. ckpt=runs/gpt-tiny"
        )
    if prompt is not None:
        cfg.generate.prompt = prompt
    check_generate(cfg)
    from suite.infer.engines import load_engine
    from suite.infer.generate import check_prompts, encode_prompt, generate_texts, read_prompts

    g = cfg.generate
    texts = read_prompts(g.prompts_file) if g.prompts_file else [g.prompt]
    engine, tokenizer, described = load_engine(cfg.ckpt, _device(cfg.train.device), compile=g.compile)
    prompts = [encode_prompt(tokenizer, text, g.chat) for text in texts]
    if not all(prompts):
        raise ConfigError('generate.prompt is empty; pass prompt="some text"')
    check_prompts(prompts, g.max_new_tokens, engine.max_seq_len)
    _say(described)
    stream = g.stream and len(texts) == 1 and "--json" not in flags
    if stream:
        print(texts[0] if not g.chat else "", end="", flush=True)
    outputs = generate_texts(
        engine, tokenizer, prompts, g, on_text=(lambda t: print(t, end="", flush=True)) if stream else None
    )
    if stream:
        print()
        return 0
    results = [{"prompt": p, "text": t} for p, t in zip(texts, outputs)]
    if len(results) == 1:
        shown = results[0]["text"] if g.chat else texts[0] + outputs[0]
        return _report(flags, results[0], shown)
    shown = "\n".join(f"### {r['prompt']}\n{r['text']}" for r in results)
    return _report(flags, {"results": results}, shown)


def cmd_chat(overrides: list[str], flags: set[str]) -> int:
    """An interactive conversation on the console: each line is a user turn, rendered with the
    model's chat template together with the history; the reply streams. /exit or end of input stops."""
    _, cfg = _compose(overrides)
    if not cfg.ckpt:
        raise ConfigError("ckpt is missing; pass ckpt=<a finetuned run, hf:<folder> or export folder>")
    from suite.infer.checks import check_generate
    from suite.infer.engines import load_engine
    from suite.infer.generate import generate_texts

    check_generate(cfg)
    engine, tokenizer, described = load_engine(
        cfg.ckpt, _device(cfg.train.device), compile=cfg.generate.compile
    )
    _say(f"{described}\nchat: type a message; /exit or Ctrl-D ends")
    from suite.data.chat import prompt_ids, resolve_chat_template

    template = resolve_chat_template(tokenizer)
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = prompt_ids(tokenizer, history, template)
        if len(ids) >= engine.max_seq_len - 1:  # the oldest turns go first
            history = history[-1:]
            ids = prompt_ids(tokenizer, history, template)
        reply = generate_texts(
            engine, tokenizer, [ids], cfg.generate, on_text=lambda t: print(t, end="", flush=True)
        )[0]
        print()
        history.append({"role": "assistant", "content": reply})


def _device(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def cmd_export(overrides: list[str], flags: set[str]) -> int:
    cfg, source = _compose_with_ckpt(overrides, "runs/gpt-tiny")
    fmt = cfg.export.format
    validate(cfg, needs_data=False, writes_run=False)
    if fmt in ("torch_export", "onnx"):
        return _export_graphs(cfg, source, flags)
    from suite.export.gguf_cli import export_gguf_or_quantized_hf

    exported = export_gguf_or_quantized_hf(
        cfg, source
    )  # format=gguf; format=hf of a `suite quantize` checkpoint
    if exported is not None:
        record_export(cfg, source, Path(exported[0]["out"]))
        return _report(flags, *exported, source)
    from suite.compress.checks import refuse_quantized

    refuse_quantized(cfg.ckpt, "ckpt", "exporting")
    from suite.export.checks import check_export_out, check_hf_exportable, export_out

    check_export_out(cfg.export.out)
    check_hf_exportable(source.model_config())
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


def cmd_eval(overrides: list[str], flags: set[str]) -> int:
    cfg, source = _compose_with_ckpt(overrides, "runs/sft-tiny")
    from suite.infer.checks import check_eval

    check_eval(cfg)
    if cfg.eval.harness is not None:  # lm_eval is optional: imported on this path only
        from suite.infer.harness import harness_text, run_harness  # one line when lm_eval is missing

        result = run_harness(source, cfg.eval, device=cfg.train.device)
        return _report(flags, result, harness_text(result), source)
    if world_size(cfg) > 1:  # tensor parallel perplexity: the workers each read their shard
        from suite.infer.perplexity import perplexity_text

        result = _launch_perplexity(_compose(overrides)[0], source)
        return _report(flags, result, perplexity_text(result), source)
    if cfg.eval.metric == "perplexity":
        from suite.infer.perplexity import evaluate_perplexity, perplexity_text

        result = evaluate_perplexity(source, cfg, device=cfg.train.device)
        return _report(flags, result, perplexity_text(result), source)
    from suite.infer.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(source, cfg.eval, device=cfg.train.device)
    lines = [
        f"  {'ok ' if ex['correct'] else 'err'} {ex['prompt']!r} -> {ex['prediction']!r} "
        f"(reference {ex['reference']!r})"
        for ex in result["examples"]
    ]
    lines.append(
        f"{result['task']}: exact match {result['accuracy']:.1%} ({result['correct']}/{result['total']} "
        f"held-out questions), {result['ckpt']}"
    )
    return _report(flags, result, "\n".join(lines), source)


def _launch_perplexity(raw: Any, source: Any) -> dict[str, Any]:
    """In the parent: check, launch the workers, return rank 0's result."""
    from suite.config.compose import to_object
    from suite.launch.launcher import launch

    cfg = to_object(raw)
    e = cfg.eval
    if e.harness is not None or e.metric != "perplexity":
        raise ConfigError(
            f"launch.nproc_per_node={cfg.launch.nproc_per_node} runs metric=perplexity only; "
            "run task accuracy and harness tasks in one process (launch.nproc_per_node=1)"
        )
    if source.quantized or source.lora is not None:
        raise ConfigError(
            f"{source.named} is a {'quantized' if source.quantized else 'LoRA'} checkpoint; eval under tensor "
            "parallelism reads plain weights: export it (merge_lora=true for LoRA) and pass ckpt=hf:<folder>, "
            "or run in one process"
        )
    model = dataclasses.asdict(source.model_config())
    model.update(dropout=0.0, init_from=None)
    for key, value in model.items():
        raw.model[key] = value
    raw.train.precision = "fp32"  # as the single-process figure (load_for_inference: fp32)
    raw.data.seq_len = e.seq_len or model["max_seq_len"]  # training's window: no part of eval, kept valid
    cfg = to_object(raw)
    dims = validate(cfg, needs_data=False, writes_run=False)
    others = {
        axis: getattr(dims, axis)
        for axis in ("dp", "sharding", "pp", "cp", "ep")
        if getattr(dims, axis, 1) > 1
    }
    if others or dims.tp != dims.world_size:
        raise ConfigError(
            f"suite eval runs under tensor parallelism only; got {others or dims.world_size} — set "
            f"parallel.tp=launch.nproc_per_node (e.g. parallel.tp={dims.world_size}) and no other degree"
        )
    from suite.infer.perplexity import check_window

    check_window(e.seq_len, e.stride, cfg.model.max_seq_len)
    folder = Path(tempfile.mkdtemp(prefix="suite-eval-"))
    try:
        raw.run.dir = str(folder)  # where rank 0 writes the result
        launch("eval", OmegaConf.to_yaml(raw), cfg.launch, folder, device=cfg.train.device)
        result = json.loads((folder / RESULT).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result
