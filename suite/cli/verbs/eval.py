"""`suite eval`: task accuracy, perplexity (also under tensor parallelism) or lm-eval harness tasks."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from suite.cli.common import _compose, _compose_with_ckpt, _report
from suite.config.errors import ConfigError
from suite.config.validate import world_size
from suite.infer.parallel_eval import RESULT
from suite.preflight import validate
from suite.verb import Verb, register


def run(overrides: list[str], flags: set[str]) -> int:
    cfg, source = _compose_with_ckpt(overrides, "runs/sft-tiny")
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.checks import check_eval

    check_eval(cfg)
    if cfg.eval.harness is not None:  # lm_eval is optional: imported on this path only
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.infer.harness import harness_text, run_harness  # one line when lm_eval is missing

        result = run_harness(source, cfg.eval, device=cfg.train.device)
        return _report(flags, result, harness_text(result), source)
    if world_size(cfg) > 1:  # tensor parallel perplexity: the workers each read their shard
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.infer.perplexity import perplexity_text

        result = _launch_perplexity(_compose(overrides)[0], source)
        return _report(flags, result, perplexity_text(result), source)
    if cfg.eval.metric == "perplexity":
        # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
        from suite.infer.perplexity import evaluate_perplexity, perplexity_text

        result = evaluate_perplexity(source, cfg, device=cfg.train.device)
        return _report(flags, result, perplexity_text(result), source)
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
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
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
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
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.perplexity import check_window

    check_window(e.seq_len, e.stride, cfg.model.max_seq_len)
    folder = Path(tempfile.mkdtemp(prefix="suite-eval-"))
    try:
        raw.run.dir = str(folder)  # where rank 0 writes the result
        launch(
            "eval",
            OmegaConf.to_yaml(raw),
            cfg.launch,
            folder,
            device=cfg.train.device,
            preload=VERB.rank_imports,
        )
        result = json.loads((folder / RESULT).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


HELP = """usage: suite eval ckpt=<run.dir|checkpoint dir|hf:folder|quantized dir> [task=NAME | metric=perplexity | harness=TASK,...] [--json]

Three evaluations of any model source:
  (default)          greedy exact-match accuracy on a built-in task's held-out questions (the ones finetuning
                     held out: same finetune.data.task_seed, the first eval.num_samples); `task=` (eval.task),
                     default the task the checkpoint was finetuned on
  metric=perplexity  sliding-window perplexity (the windows of Hugging Face's perplexity guide): windows of
                     eval.seq_len tokens (default model.max_seq_len) every eval.stride tokens (default seq_len),
                     each scoring the tokens the previous one did not; eval.data = unset (the run's validation
                     shards; for hf: give data.path) | FILE.txt | FILE.jsonl ("text" per line, documents joined
                     with eos) | hf:<dataset>[:<config>][:<split>]; eval.max_tokens caps the tokens scored;
                     eval.batch_size windows per forward; launch.nproc_per_node=N parallel.tp=N: tensor parallel
  harness=TASK,...   lm-evaluation-harness tasks through the `suite` lm_eval model (pip install 'suite[harness]'):
                     the shipped offline task suite_tiny_mc, or lm_eval's own task names; eval.limit samples per
                     task, eval.batch_size

Examples:
  suite eval ckpt=runs/sft-tiny
  suite eval ckpt=runs/sft-tiny task=reverse-6 eval.num_samples=50 --json
  suite eval ckpt=runs/gpt-tiny metric=perplexity eval.seq_len=128 eval.stride=64 eval.max_tokens=4000
  suite eval ckpt=runs/gpt-tiny harness=suite_tiny_mc eval.limit=10 --json"""


def in_rank(cfg, dims, resolved_yaml: str) -> int:
    """One rank of metric=perplexity under tensor parallelism (suite.infer.parallel_eval)."""
    # deferred: the engine loads only for the verb that runs (suite/cli/verbs/__init__.py)
    from suite.infer.parallel_eval import run_worker

    return run_worker(cfg, dims)


VERB = register(
    Verb(
        name="eval",
        summary="task accuracy, perplexity (metric=perplexity), lm-eval tasks (harness=suite_tiny_mc)",
        help=HELP,
        run=run,
        unused=("export", "prune", "distill", "optim", "sched", "recompute", "cluster", "align"),
        section="use",
        in_rank=in_rank,
        rank_imports=("suite.infer.parallel_eval",),
        stage_output="result",
    )
)
