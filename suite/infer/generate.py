"""Sampling with a KV cache from any model source (suite.sources)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig
from suite.models import KVCache, Transformer
from suite.models.quantized import is_quantized, load_quantized_model
from suite.sources import ModelSource


def load_for_inference(
    ckpt: str | Path | ModelSource, device: str = "cpu"
) -> tuple[Transformer, object, Path]:
    """Model (LoRA adapters merged), tokenizer and the folder read, from any model source."""
    source = ModelSource.parse(ckpt, "ckpt")
    if not source.is_hf and is_quantized(source.folder):  # written by `suite quantize`
        return (
            load_quantized_model(source.folder, source.model_config(), device),
            source.tokenizer(),
            source.folder,
        )
    return source.load_model(device), source.tokenizer(), source.folder


def sample_next(logits: torch.Tensor, cfg: GenerateConfig, generator: torch.Generator) -> torch.Tensor:
    """One token per row from [b, vocab] logits: greedy at temperature 0, else top-k / top-p sampling."""
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > cfg.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate_tokens(
    model: Transformer, prompt_ids: list[int], cfg: GenerateConfig, eos_id: int | None = None
) -> list[int]:
    """Prefill the prompt once, then decode one token at a time from the cache."""
    device = next(model.parameters()).device
    limit = model.cfg.max_seq_len
    if len(prompt_ids) >= limit:
        prompt_ids = prompt_ids[-(limit - 1) :]
    budget = min(cfg.max_new_tokens, limit - len(prompt_ids))
    cache = KVCache.empty(model, batch=1, max_len=len(prompt_ids) + budget)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    logits = model(torch.tensor([prompt_ids], device=device), kv_cache=cache)[:, -1]
    out: list[int] = []
    for _ in range(budget):
        token = sample_next(logits, cfg, generator)
        out.append(int(token))
        if eos_id is not None and out[-1] == eos_id:
            break
        logits = model(token.view(1, 1), kv_cache=cache)[:, -1]
    return out


def fit_context(prompt_len: int, max_new_tokens: int, limit: int) -> int:
    """Tokens `suite generate` can add: a prompt that leaves no room is refused; a budget beyond the
    context is cut to what fits, said on stderr (never silently)."""
    if prompt_len >= limit:
        raise ConfigError(
            f"the prompt is {prompt_len} tokens, longer than the model's context allows: model.max_seq_len={limit} "
            f"leaves room for at most {limit - 1} prompt tokens; shorten the prompt (the model cannot see more)"
        )
    room = limit - prompt_len
    if max_new_tokens > room:
        print(
            f"note: generation stops at the context length: the prompt ({prompt_len} tokens) + "
            f"generate.max_new_tokens={max_new_tokens} exceed model.max_seq_len={limit}; at most {room} new tokens",
            file=sys.stderr,
        )
    return min(max_new_tokens, room)


def generate_from_checkpoint(ckpt: str, cfg: GenerateConfig, device: str = "auto") -> str:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _ = load_for_inference(ckpt, device)
    prompt_ids = tokenizer.encode(cfg.prompt, add_special_tokens=False)
    if not prompt_ids:
        raise ConfigError('generate.prompt is empty; pass prompt="some text"')
    fit_context(len(prompt_ids), cfg.max_new_tokens, model.cfg.max_seq_len)
    ids = generate_tokens(model, prompt_ids, cfg, tokenizer.eos_token_id)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids)
