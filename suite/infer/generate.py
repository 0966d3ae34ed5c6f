"""Sampling with a KV cache from any model source (suite.model_source)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig
from suite.data.chat import checkpoint_chat_template, prompt_ids
from suite.model_source import ModelSource
from suite.models import KVCache, Transformer
from suite.models.int4_cpu import pack_for_cpu
from suite.models.quantized import is_quantized, load_quantized_model


def load_for_inference(
    ckpt: str | Path | ModelSource, device: str = "cpu", packed: bool = True
) -> tuple[Transformer, object, Path]:
    """Model (LoRA adapters merged), tokenizer and the folder read, from any model source. A
    `suite quantize` checkpoint on CPU computes with the packed int4/int8 kernels when `packed`
    (suite.models.int4_cpu: bf16 activations into them); packed=False keeps torchao's stored tensors
    (what an export writes out)."""
    source = ModelSource.parse(ckpt, "ckpt")
    if not source.is_hf and is_quantized(source.folder):  # written by `suite quantize`
        model = load_quantized_model(source.folder, source.model_config(), device)
        if packed and torch.device(device).type == "cpu":
            pack_for_cpu(model)
        return model, source.tokenizer(), source.folder
    return source.load_model(device), source.tokenizer(), source.folder


def sampling_logits(logits: torch.Tensor, cfg: GenerateConfig) -> torch.Tensor:
    """The fp32 logits of the distribution `sample_next` draws from at temperature > 0: divided by the
    temperature, tokens outside top-k / top-p at -inf (their softmax is that distribution)."""
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
    return logits


def sample_next(logits: torch.Tensor, cfg: GenerateConfig, generator: torch.Generator) -> torch.Tensor:
    """One token per row from [b, vocab] logits: greedy at temperature 0, else top-k / top-p sampling."""
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = sampling_logits(logits, cfg).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


def sample_with_logprobs(
    logits: torch.Tensor, cfg: GenerateConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [b, 1], log-probability of each under the distribution it was drawn from, its plain
    log-probability log_softmax(logits)): what reinforcement learning records per sampled token.
    The plain one is what a trainer recomputes from its own forward: suite.align.grpo compares the two
    before every update and takes its importance ratios against it (both sides at temperature 1); the
    first says how far temperature and top-p moved the draw from the policy (kept for diagnostics)."""
    if cfg.temperature <= 0:
        raise ValueError("sampling with log-probabilities needs temperature > 0")
    sampling = sampling_logits(logits, cfg).log_softmax(-1)
    token = torch.multinomial(sampling.exp(), 1, generator=generator)
    plain = logits.float().log_softmax(-1)
    return token, sampling.gather(-1, token), plain.gather(-1, token)


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


def read_prompts(value: str) -> list[str]:
    """generate.prompts_file: a text file with one prompt per line (blank lines skipped), or JSONL
    ({"prompt": ...} per line)."""
    path = Path(value).expanduser()
    fix = 'give a text file with one prompt per line, or JSONL lines {"prompt": "..."}'
    if not path.is_file():
        raise ConfigError(f"generate.prompts_file='{value}' does not exist or is not a file; {fix}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"generate.prompts_file='{value}' is not UTF-8 text (byte {exc.start}); {fix}"
        ) from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                prompt = record["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(
                    f"generate.prompts_file='{value}' line {number} is not a JSON object with a \"prompt\"; {fix}"
                ) from None
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(
                    f"generate.prompts_file='{value}' line {number}: the prompt is empty; {fix}"
                )
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"generate.prompts_file='{value}' holds no prompts; {fix}")
    return prompts


def encode_prompt(tokenizer, text: str, chat: bool, ckpt: str = "") -> list[int]:
    """The prompt's ids: as typed, or (generate.chat) as a user turn under the checkpoint's own chat
    template (refused in one line when it has none), ready for the assistant's reply."""
    if chat:
        template = checkpoint_chat_template(tokenizer, "generate.chat=true", ckpt)
        return prompt_ids(tokenizer, [{"role": "user", "content": text}], template)
    return tokenizer.encode(text, add_special_tokens=False)


class _Row:
    """One prompt's continuation: its ids, and whether eos or a stop sequence ended it."""

    def __init__(self, tokenizer, stop: list[str], eos_id: int | None):
        self.tokenizer, self.stop, self.eos_id = tokenizer, stop, eos_id
        self.ids: list[int] = []
        self.text = ""
        self.done = False

    def add(self, token: int) -> None:
        if self.done:
            return
        if token == self.eos_id:
            self.done = True
            return
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.done = self.text[:cut], True

    def settled(self) -> str:
        """The text that can no longer change: held back while it may be the start of a stop sequence
        or ends inside a multi-byte character."""
        if self.done:
            return self.text
        hold = max((len(s) - 1 for s in self.stop), default=0)
        text = self.text[: len(self.text) - hold] if hold else self.text
        return text.rstrip("\ufffd")


def generate_texts(
    engine,
    tokenizer,
    prompts: list[list[int]],
    cfg: GenerateConfig,
    on_text=None,
) -> list[str]:
    """Continuations of `prompts` (token ids), `cfg.batch_size` at a time (an engine that cannot pad
    takes prompts of one length per batch). on_text(new text), for a single prompt: streaming."""
    limit = engine.max_seq_len
    for ids in prompts:
        fit_context(len(ids), cfg.max_new_tokens, limit) if len(prompts) == 1 else _fits(len(ids), limit)
    order = (
        sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if not engine.pads else range(len(prompts))
    )
    order = list(order)
    generator = torch.Generator().manual_seed(cfg.seed)
    results: dict[int, str] = {}
    start = 0
    while start < len(order):
        group = [order[start]]
        while (
            len(group) < cfg.batch_size
            and start + len(group) < len(order)
            and (engine.pads or len(prompts[order[start + len(group)]]) == len(prompts[group[0]]))
        ):
            group.append(order[start + len(group)])
        start += len(group)
        batch = [prompts[i] for i in group]
        budget = min(cfg.max_new_tokens, limit - max(len(p) for p in batch))
        rows = [_Row(tokenizer, list(cfg.stop), tokenizer.eos_token_id) for _ in group]
        shown = 0
        for tokens in engine.steps(batch, budget, lambda logits: sample_next(logits, cfg, generator)):
            for row, token in zip(rows, tokens.tolist()):
                row.add(token)
            if on_text is not None:
                text = rows[0].settled()
                if len(text) > shown:
                    on_text(text[shown:])
                    shown = len(text)
            if all(row.done for row in rows):
                break
        if on_text is not None and len(rows[0].text) > shown:
            on_text(rows[0].text[shown:])
        results.update({i: row.text for i, row in zip(group, rows)})
    return [results[i] for i in range(len(prompts))]


def check_prompts(prompts: list[list[int]], max_new_tokens: int, limit: int) -> None:
    """Every prompt leaves room for a token (one prompt: the budget is cut to the context, said)."""
    for ids in prompts:
        if len(prompts) == 1:
            fit_context(len(ids), max_new_tokens, limit)
        else:
            _fits(len(ids), limit)


def _fits(prompt_len: int, limit: int) -> None:
    if prompt_len >= limit:
        raise ConfigError(
            f"a prompt of generate.prompts_file is {prompt_len} tokens; model.max_seq_len={limit} leaves room "
            f"for at most {limit - 1}: shorten it"
        )
