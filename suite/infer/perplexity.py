"""`suite eval metric=perplexity`: sliding-window perplexity of a model on one token stream.

The windows are the ones of Hugging Face's perplexity guide (docs "Perplexity of fixed-length
models"): a window of `seq_len` tokens starts every `stride` tokens; each window scores only the
tokens the previous window did not score, the earlier tokens of the window being context; the
first token of the stream is never scored, and the last window ends at the end of the stream.
A window's own first token has no context inside it, so it is not scored either: with
stride = seq_len (no overlap) each window scores seq_len - 1 tokens, as in the guide. (With
overlapping windows the guide weights each later window's mean loss by one token too few; here
each window's summed negative log-likelihood is added, so the figure is the exact token mean.)

Text sources (`eval.data`):
    unset                the validation shard of the run's prepared data folder (already token ids of
                         the run's tokenizer); for an hf: model, the recipe's data.path (its
                         tokenizer must be the model's)
    file.txt             the whole file, tokenized once (no special tokens added)
    file.jsonl           a "text" field per line; each document tokenized on its own (no special
                         tokens) and the documents joined with the tokenizer's eos token id between
    hf:<dataset>[:<config>][:<split>]
                         through `datasets`: a folder written by `Dataset.save_to_disk` is read with
                         `load_from_disk`, anything else with `load_dataset` (a local folder of
                         .jsonl/.txt/.parquet files works offline; a hub name needs the network);
                         split default: test, else validation, else train; column "text"; documents
                         joined with eos like .jsonl
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from suite.config.errors import ConfigError
from suite.data import IndexedTokens, ensure_prepared, load_tokenizer
from suite.infer.generate import load_for_inference

HF_PREFIX = "hf:"


def windows(num_tokens: int, seq_len: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored index) of each window over a stream of `num_tokens` tokens: the
    window holds tokens [begin, end) and scores the tokens [first, end), each predicted from the
    window's tokens before it."""
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + seq_len, num_tokens)
        first = max(prev_end, begin + 1)  # a window's own first token has no context in it
        if end > first:
            yield begin, end, first
        prev_end = end
        if end == num_tokens:
            break


@torch.no_grad()
def sliding_window_nll(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    seq_len: int,
    stride: int,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """Summed negative log-likelihood of `tokens` (1-D ids) over the sliding windows, windows of
    equal length batched `batch_size` at a time. Returns {"nll", "tokens", "windows"}."""
    spans = list(windows(int(tokens.numel()), seq_len, stride))
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    bar = _progress(len(spans), progress)
    try:
        for i in range(0, len(spans), batch_size):
            group = spans[i : i + batch_size]
            for same in _same_length(group):
                ids = torch.stack([tokens[b:e] for b, e, _ in same]).to(device=device, dtype=torch.long)
                logits = model(ids)
                if hasattr(logits, "full_tensor"):  # tensor parallel: logits sharded over the vocabulary
                    logits = logits.full_tensor()
                logp = logits.float().log_softmax(-1)
                for row, (b, e, first) in enumerate(same):
                    targets = ids[row, first - b :]
                    picked = logp[row, first - b - 1 : e - b - 1].gather(-1, targets[:, None])
                    total -= float(picked.double().sum())
                    count += e - first
            if bar is not None:
                bar[0].update(bar[1], advance=len(group))
    finally:
        model.train(was_training)
        if bar is not None:
            bar[0].stop()
    return {"nll": total, "tokens": count, "windows": len(spans)}


def _same_length(group: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Runs of windows of one length (only the last window of the stream can be shorter)."""
    runs: list[list[tuple[int, int, int]]] = []
    for span in group:
        if runs and runs[-1][0][1] - runs[-1][0][0] == span[1] - span[0]:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def _progress(total: int, enabled: bool):
    """A rich progress bar on stderr (like training's and `suite prepare`'s), or None."""
    if not enabled:
        return None
    bar = Progress(
        TextColumn("perplexity"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task("windows", total=total)
    bar.start()
    return bar, task


def check_window(seq_len: int | None, stride: int | None, max_seq_len: int | None = None) -> None:
    """eval.seq_len / eval.stride: a window holds at least two tokens, fits the model's context, and
    the stride is in [1, seq_len] (a larger stride would skip tokens)."""
    if seq_len is not None and seq_len < 2:
        raise ConfigError(
            f"eval.seq_len={seq_len} must be at least 2 (a window scores tokens after the first), "
            "or null for model.max_seq_len"
        )
    if max_seq_len is not None and seq_len is not None and seq_len > max_seq_len:
        raise ConfigError(
            f"eval.seq_len={seq_len} is longer than the model's context (model.max_seq_len={max_seq_len}); "
            f"pass eval.seq_len<={max_seq_len}, or null for the whole context"
        )
    if stride is not None and stride < 1:
        raise ConfigError(f"eval.stride={stride} must be a positive integer, or null for eval.seq_len")
    if stride is not None and seq_len is not None and stride > seq_len:
        raise ConfigError(
            f"eval.stride={stride} is larger than eval.seq_len={seq_len}, which would leave tokens unscored; "
            f"pass eval.stride={seq_len} (windows without overlap) or less"
        )


def token_stream(data: str | None, tokenizer: Any, source: Any, cfg: Any) -> tuple[torch.Tensor, str]:
    """The ids to score and a short name of where they came from (see the module docstring)."""
    if not data:
        return _validation_tokens(tokenizer, source, cfg)
    if data.startswith(HF_PREFIX):
        return _join(_dataset_texts(data), tokenizer, data), data
    path = Path(data).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"eval.data='{data}' {what}; give a .txt or .jsonl file, or hf:<dataset>")
    if path.suffix == ".jsonl":
        return _join(_jsonl_texts(path, data), tokenizer, data), str(path)
    text = _read_text(path, data)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return _checked(torch.tensor(ids, dtype=torch.long), data), str(path)


def _read_text(path: Path, data: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"eval.data='{data}' is not UTF-8 text (byte {exc.start})") from None


def _jsonl_texts(path: Path, data: str) -> list[str]:
    texts = []
    for number, line in enumerate(_read_text(path, data).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"eval.data='{data}', line {number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError(f"eval.data='{data}', line {number}: expected an object with a \"text\" string")
        texts.append(record["text"])
    return texts


def _dataset_texts(data: str) -> list[str]:
    """The "text" column of hf:<dataset>[:<config>][:<split>]."""
    parts = data[len(HF_PREFIX) :].split(":")
    name, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else None
    if not name or len(parts) > 3:
        raise ConfigError(f"eval.data='{data}' must read hf:<dataset>[:<config>][:<split>]")
    # deferred: datasets costs ~1-2 s to import; only a Hugging Face dataset's text needs it
    import datasets

    try:
        local = Path(name).expanduser()
        if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(local))
        else:
            loaded = datasets.load_dataset(name, config)
    except ConfigError:
        raise
    except Exception as exc:  # offline hub names, missing folders: one line, the cause named
        raise ConfigError(f"eval.data='{data}' cannot be loaded by datasets: {exc}".splitlines()[0]) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            split = next((s for s in ("test", "validation", "train") if s in loaded), None)
        if split not in loaded:
            raise ConfigError(f"eval.data='{data}' has no split '{split}'; its splits: {', '.join(loaded)}")
        loaded = loaded[split]
    if "text" not in loaded.column_names:
        raise ConfigError(
            f"eval.data='{data}' has no \"text\" column; its columns: {', '.join(loaded.column_names)}"
        )
    return [t for t in loaded["text"] if t]


def _join(texts: list[str], tokenizer: Any, data: str) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i, text in enumerate(texts):
        if i and eos is not None:
            ids.append(eos)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return _checked(torch.tensor(ids, dtype=torch.long), data)


def _checked(ids: torch.Tensor, data: str) -> torch.Tensor:
    if ids.numel() < 2:
        raise ConfigError(
            f"eval.data='{data}' holds {ids.numel()} token(s); perplexity needs at least 2 (give more text)"
        )
    return ids


def _validation_tokens(tokenizer: Any, source: Any, cfg: Any) -> tuple[torch.Tensor, str]:
    """The val shard of the run's data folder (or, for an hf: model, the recipe's data.path)."""
    data_cfg = source.saved.data if source.saved is not None else cfg.data
    if source.saved is None and not data_cfg.path:
        raise ConfigError(
            f"{source.named} is an HF folder, so there are no run validation shards to read; pass "
            "eval.data=<file.txt|file.jsonl|hf:dataset>, or data.path=<a folder prepared with its tokenizer>"
        )
    folder = ensure_prepared(data_cfg, progress=False)
    if load_tokenizer(folder).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"the validation shards of {folder} were tokenized with another tokenizer than {source.named}'s; "
            "pass eval.data=<file.txt|file.jsonl|hf:dataset> (tokenized with the model's tokenizer)"
        )
    val = IndexedTokens(folder / "val")
    if val.num_tokens < 2:
        raise ConfigError(
            f"{folder} holds {val.num_tokens} validation tokens (data.val_fraction=0?); pass eval.data=<file>"
        )
    return torch.from_numpy(val.tokens.astype("int64")), f"{folder}/val"


def evaluate_perplexity(source: Any, cfg: Any, device: str = "auto") -> dict[str, Any]:
    """`suite eval metric=perplexity` in this process: load the model once, score the stream."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, folder = load_for_inference(source, device)
    return score_model(model, tokenizer, source, cfg, folder, cfg.log.progress)


def score_model(
    model: torch.nn.Module, tokenizer: Any, source: Any, cfg: Any, folder: Any, progress: bool
) -> dict[str, Any]:
    """The result of `suite eval metric=perplexity` for a loaded (possibly tensor-parallel) model."""
    e = cfg.eval
    max_seq_len = model.cfg.max_seq_len
    check_window(e.seq_len, e.stride, max_seq_len)
    seq_len = e.seq_len or max_seq_len
    stride = e.stride or seq_len
    check_window(seq_len, stride)
    tokens, data = token_stream(e.data, tokenizer, source, cfg)
    if e.max_tokens is not None:
        tokens = tokens[: e.max_tokens + 1]  # the first token is context only
    out = sliding_window_nll(model, tokens, seq_len, stride, e.batch_size, progress=progress)
    loss = out["nll"] / out["tokens"]
    return {
        "perplexity": math.exp(min(loss, 700.0)),
        "loss": loss,
        "tokens": out["tokens"],
        "windows": out["windows"],
        "seq_len": seq_len,
        "stride": stride,
        "data": data,
        "ckpt": str(folder),
    }


def perplexity_text(result: dict[str, Any]) -> str:
    """The human-readable summary: one table of the figures."""
    rows = [
        ("perplexity", f"{result['perplexity']:.4f}"),
        ("loss (nats/token)", f"{result['loss']:.6f}"),
        ("tokens scored", f"{result['tokens']:,}"),
        ("windows", f"{result['windows']:,} (seq_len {result['seq_len']}, stride {result['stride']})"),
        ("data", result["data"]),
        ("ckpt", result["ckpt"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
