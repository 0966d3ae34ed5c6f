"""What a compression command measures, before and after: size, held-out perplexity, decode speed.

params              parameters of the model (a quantized weight counts its logical elements)
file_bytes          the weights file: the full-precision model as safetensors (before), the
                    quantized checkpoint's model.safetensors (after)
block_bytes         the transformer blocks' tensors alone (layers.*: no embeddings, no head)
perplexity, loss    token-weighted, on the recipe's held-out data (suite.infer.evaluate.perplexity)
task_accuracy       a run finetuned on a built-in task: greedy exact match on compress.task_samples
                    of its held-out questions (suite.infer.evaluate.evaluate_task)
decode_tokens_per_s a greedy generate with the KV cache (prompt + compress.decode_tokens tokens,
                    after one warm-up call), tokens generated / seconds, the best of 3 calls
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from suite.config.schema import GenerateConfig
from suite.data.tasks import get_task
from suite.infer.evaluate import evaluate_task, perplexity
from suite.infer.generate import generate_tokens


def stored_bytes(path: str | Path) -> tuple[int, int]:
    """(whole safetensors file, bytes of the tensors under layers.*) as stored."""

    block = 0
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            if name.startswith("layers."):
                piece = handle.get_slice(name)
                numel = 1
                for n in piece.get_shape():
                    numel *= n
                block += numel * _itemsize(piece.get_dtype())
    return Path(path).stat().st_size, block


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(dtype, 1)


def save_plain(model: nn.Module, path: Path) -> Path:
    """The full-precision model's weights as one safetensors file (the `before` size)."""

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("output.weight", None)
    save_file(state, str(path))
    return path


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def decode_speed(model: nn.Module, prompt: list[int], tokens: int, repeats: int = 3) -> float:
    """Greedy tokens per second of a KV-cache generate: the best of `repeats` timed calls after one
    warm-up call (other work on a shared machine only ever slows a call down)."""

    cfg = GenerateConfig(max_new_tokens=tokens, temperature=0.0, top_k=None, top_p=None)
    generate_tokens(model, prompt, GenerateConfig(max_new_tokens=2, temperature=0.0, top_k=None, top_p=None))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate_tokens(model, prompt, cfg)
        rates.append(len(out) / (time.perf_counter() - start))
    return max(rates)


def measure(
    model: nn.Module,
    batches: list | None,
    prompt: list[int],
    tokens: int,
    tokenizer: Any = None,
    task: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Perplexity (None without held-out data), decode speed and, with `task` ({task, file,
    template, limit}: a run finetuned on a built-in task), held-out exact match of `model`."""

    row: dict[str, Any] = {"params": count_params(model)}
    if task is not None:
        result = evaluate_task(
            model,
            tokenizer,
            task["task"],
            task["file"],
            max_new_tokens=get_task(task["task"]).max_answer_chars + 2,
            limit=task["limit"],
            template=task["template"],
            num_examples=0,
        )
        row.update(task_accuracy=result["accuracy"], task_questions=result["total"])
    if batches:
        result = perplexity(model, batches)
        row.update(loss=result["loss"], perplexity=result["perplexity"], eval_tokens=result["tokens"])
    else:
        row.update(loss=None, perplexity=None, eval_tokens=0)
    row["decode_tokens_per_s"] = decode_speed(model, prompt, tokens)
    return row


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 1000 else f"{value:,.0f}"
    return f"{value:,}"


def table(
    before: dict[str, Any], after: dict[str, Any], shapes: dict[str, tuple[int, int]] | None = None
) -> str:
    """The console table: one row per measure, before / after / ratio (first the `shapes` rows, e.g.
    the layer and head counts a pruning changed)."""
    rows = [
        ("parameters", "params"),
        ("weights file (bytes)", "file_bytes"),
        ("block weights (bytes)", "block_bytes"),
        ("held-out perplexity", "perplexity"),
        ("task exact match", "task_accuracy"),
        ("decode tokens/s", "decode_tokens_per_s"),
    ]
    lines = [f"{'':24s}{'before':>16s}{'after':>16s}{'after/before':>14s}"]
    for label, (a, b) in (shapes or {}).items():
        lines.append(f"{label:24s}{a:>16d}{b:>16d}{b / a:>14.3f}")
    for label, key in rows:
        if key not in before:
            continue
        a, b = before.get(key), after.get(key)
        ratio = f"{b / a:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else ""
        lines.append(f"{label:24s}{_fmt(a):>16s}{_fmt(b):>16s}{ratio:>14s}")
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, Any]) -> Path:
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
