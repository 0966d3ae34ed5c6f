"""Evaluation: task accuracy by generating answers, and perplexity over (masked) batches.

evaluate_task renders each held-out conversation's prompt with the same chat template and the
same segment-wise tokenization as training (suite.data.chat.prompt_ids), decodes greedily with the
KV cache (suite.infer.generate.generate_tokens) until the eos token, and scores the decoded reply
against the reference with the task's exact match.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, SFTDataConfig
from suite.data.batch import Batch
from suite.data.chat import MalformedRow, normalize_record, prompt_ids, resolve_chat_template
from suite.data.sft import iter_sft_rows
from suite.data.tasks import get_task, score, write_task
from suite.infer.generate import generate_tokens, load_for_inference
from suite.model_source import ModelSource
from suite.train.loss import cross_entropy


def _eval_rows(eval_file: str | Path, limit: int | None) -> list[tuple[list[dict[str, str]], str]]:
    rows = []
    for location, record in iter_sft_rows(str(eval_file)):
        if limit is not None and len(rows) >= limit:
            break
        try:
            messages = normalize_record(record)
        except MalformedRow as err:
            raise ConfigError(
                f"{location}: {err.detail}; the eval file must hold well-formed chat rows"
            ) from err
        rows.append((messages[:-1], messages[-1]["content"]))
    if not rows:
        raise ConfigError(f"eval file '{eval_file}' holds no rows")
    return rows


@torch.no_grad()
def evaluate_task(
    model: torch.nn.Module,
    tokenizer: Any,
    task_name: str,
    eval_file: str | Path,
    max_new_tokens: int = 16,
    limit: int | None = None,
    template: str | None = "auto",
    num_examples: int = 5,
) -> dict[str, Any]:
    """Exact-match accuracy of greedy answers on the held-out file.

    Returns {"accuracy", "correct", "total", "examples"}; examples: the first `num_examples`
    {"prompt", "reference", "prediction", "correct"} records (prompt = the last user message).
    `template` must be the one used in training ("auto": the tokenizer's own, else chatml).
    """
    chat_template = resolve_chat_template(tokenizer, template)
    eos_id = tokenizer.eos_token_id
    eos_text = tokenizer.eos_token or ""
    cfg = GenerateConfig(max_new_tokens=max_new_tokens, temperature=0.0, top_k=None, top_p=None)
    was_training = model.training
    model.eval()
    correct = 0
    examples = []
    rows = _eval_rows(eval_file, limit)
    try:
        for history, reference in rows:
            ids = generate_answer_ids(model, tokenizer, history, chat_template, cfg, eos_id)
            prediction = tokenizer.decode(ids, skip_special_tokens=False)
            if eos_text and eos_text in prediction:  # a template whose turn ends in another token
                prediction = prediction.split(eos_text, 1)[0]
            ok = score(task_name, prediction, reference)
            correct += int(ok)
            if len(examples) < num_examples:
                examples.append(
                    {
                        "prompt": history[-1]["content"],
                        "reference": reference,
                        "prediction": prediction.strip(),
                        "correct": ok,
                    }
                )
    finally:
        model.train(was_training)
    total = len(rows)
    return {"accuracy": correct / total, "correct": correct, "total": total, "examples": examples}


def evaluate_checkpoint(ckpt: str, eval_cfg, device: str = "auto") -> dict[str, Any]:
    """`suite eval`: a checkpoint's exact match on a built-in task's held-out questions.

    The questions are the ones finetuning held out (the run's finetune.data.task_seed; the first
    eval.num_samples, default the run's num_eval), regenerated here, so they never overlap the
    training questions as long as num_samples <= the run's num_eval.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    source = ModelSource.parse(ckpt, "ckpt")
    model, tokenizer, folder = load_for_inference(source, device)
    run_data = source.saved.finetune.data if source.saved is not None else SFTDataConfig()
    task = eval_cfg.task or run_data.task
    if not task:
        raise ConfigError(
            f"{source.named} was not finetuned on a built-in task; pass task=<name>, e.g. task=reverse-6"
        )
    num = eval_cfg.num_samples or run_data.num_eval
    if task == run_data.task and num > run_data.num_eval:  # more would score questions it trained on
        print(
            f"note: eval.num_samples={num} is more than the {run_data.num_eval} questions the run held out "
            f"(finetune.data.num_eval); scoring those {run_data.num_eval}",
            file=sys.stderr,
            flush=True,
        )
        num = run_data.num_eval
    with tempfile.TemporaryDirectory(prefix="suite-eval-") as tmp:
        files = write_task(task, tmp, 0, num, seed=run_data.task_seed)
        result = evaluate_task(
            model,
            tokenizer,
            task,
            files["eval"],
            max_new_tokens=eval_cfg.max_new_tokens or get_task(task).max_answer_chars + 2,
        )
    return {"task": get_task(task).name, "ckpt": str(folder), **result}


def generate_answer_ids(
    model: torch.nn.Module,
    tokenizer: Any,
    history: list[dict[str, str]],
    chat_template: str,
    cfg: GenerateConfig,
    eos_id: int | None,
) -> list[int]:
    """Greedy (per cfg) reply ids to `history` (ending with a user message), eos removed."""
    ids = generate_tokens(model, prompt_ids(tokenizer, history, chat_template), cfg, eos_id)
    if ids and eos_id is not None and ids[-1] == eos_id:
        ids = ids[:-1]
    return ids


@torch.no_grad()
def perplexity(model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
    """Token-weighted mean loss and perplexity over the target tokens of `batches`
    (suite.data.batch.Batch: labels masked, positions and document masks honoured).
    Returns {"loss", "perplexity", "tokens"}."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            batch = batch.to(device)
            total += float(cross_entropy(model(batch.tokens, **batch.model_kwargs()), batch.labels, "sum"))
            count += batch.num_targets
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("perplexity: the batches hold no target tokens")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}
