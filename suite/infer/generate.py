"""Sampling with a KV cache from a suite checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from suite.config.compose import load_saved_config
from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig
from suite.models import KVCache, Transformer, build_model, materialize
from suite.train.checkpoint import load_model_weights, resolve_checkpoint


def load_for_inference(ckpt: str | Path, device: str = "cpu") -> tuple[Transformer, object, Path]:
    """Model (weights from the newest good checkpoint), tokenizer and the checkpoint folder."""
    from suite.data import load_tokenizer

    if str(ckpt).startswith("hf:"):
        from suite.export.hf import load_hf_model

        folder = Path(str(ckpt)[3:]).expanduser()
        model, tokenizer = load_hf_model(folder, device)
        if tokenizer is None:
            raise ConfigError(f"ckpt='{ckpt}': the folder has no tokenizer files to encode the prompt")
        return model, tokenizer, folder
    folder = resolve_checkpoint(ckpt)
    cfg = load_saved_config(folder / "config.yaml")
    model = materialize(build_model(cfg.model), device, seed=0)
    if cfg.finetune.method == "lora":  # the checkpoint holds base + adapters: fold them in
        from suite.finetune.lora import apply_lora, merge_lora

        lo = cfg.finetune.lora
        apply_lora(model, lo.rank, lo.alpha, lo.dropout, tuple(lo.target_modules))
        load_model_weights(folder, model)
        merge_lora(model)
    else:
        load_model_weights(folder, model)
    model.eval()
    run_dir = folder.parent.parent
    tokenizer_dir = run_dir if (run_dir / "tokenizer.json").is_file() else None
    if tokenizer_dir is None:
        raise ConfigError(
            f"ckpt='{ckpt}': no tokenizer.json in {run_dir}; was it written by `suite pretrain`?"
        )
    return model, load_tokenizer(tokenizer_dir), folder


def lora_run(ckpt: str | Path) -> bool:
    """Whether a suite checkpoint was finetuned with LoRA (False for hf: folders)."""
    if str(ckpt).startswith("hf:"):
        return False
    folder = resolve_checkpoint(ckpt)
    return load_saved_config(folder / "config.yaml").finetune.method == "lora"


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


def generate_from_checkpoint(ckpt: str, cfg: GenerateConfig, device: str = "auto") -> str:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _ = load_for_inference(ckpt, device)
    prompt_ids = tokenizer.encode(cfg.prompt, add_special_tokens=False)
    if not prompt_ids:
        raise ConfigError('generate.prompt is empty; pass prompt="some text"')
    ids = generate_tokens(model, prompt_ids, cfg, tokenizer.eos_token_id)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids)
