"""bench/generate.py's real-model pieces: llama.cpp (llama-cpp-python) on the suite's own GGUF exports,
the bytes of weights a decode step reads, the memory bandwidth that bounds it, and the suite's
per-token dispatch overhead (the same ops on tiny weights)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

GGUF_QUANTS = ("f16", "q8_0", "q4_0")  # the suite's own exports llama.cpp decodes (export.quantize=)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` sums of a `gib` GiB fp32 tensor (a read-only stream, as decode)."""
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def suite_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, the embedding table only as the
    (tied) head (a step reads one row of it otherwise)."""
    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen or (name.startswith("tok_embeddings.") and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def gguf_bytes_per_token(path: Path) -> int:
    """The same for a GGUF file: its tensors' bytes, the token embedding only when it is the head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    return total - tensors["token_embd.weight"] if "output.weight" in tensors else total


class LlamaCpp:
    """Greedy decoding of a batch of equal-length prompts in llama.cpp, one sequence id per prompt."""

    def __init__(self, path: Path, threads: int, max_batch: int, context: int):
        from llama_cpp import Llama
        from llama_cpp import _internals as internals

        self.llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=16, verbose=False)
        params = self.llm.context_params
        params.n_ctx, params.n_batch, params.n_ubatch = (
            max_batch * context,
            max_batch * context,
            max_batch * context,
        )
        params.n_seq_max, params.kv_unified = max_batch, True
        self.ctx = internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        self.batch = internals.LlamaBatch(n_tokens=max_batch * context, embd=0, n_seq_max=max_batch)
        self.vocab = self.llm.n_vocab()

    def _argmax(self, row: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.ctx.get_logits_ith(row), shape=(self.vocab,))))

    def generate(self, prompts: list[list[int]], tokens: int) -> torch.Tensor:
        """[len(prompts), tokens] greedy tokens."""
        self.ctx.kv_cache_clear()
        batch, b = self.batch, self.batch.batch
        batch.reset()
        for seq, ids in enumerate(prompts):
            batch.add_sequence(ids, seq, False)
        self.ctx.decode(batch)
        width = len(prompts[0])
        rows = [(seq + 1) * width - 1 for seq in range(len(prompts))]
        out = []
        for step in range(tokens):
            out.append([self._argmax(r) for r in rows])
            if step == tokens - 1:
                break
            b.n_tokens = len(prompts)
            for seq, token in enumerate(out[-1]):
                b.token[seq], b.pos[seq], b.n_seq_id[seq], b.logits[seq] = token, width + step, 1, True
                b.seq_id[seq][0] = seq
            self.ctx.decode(batch)
            rows = list(range(len(prompts)))
        return torch.tensor(out).t()


def dispatch_overhead(cfg, n: int, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per decode step of the suite's eager decoder on `cfg`'s architecture with tiny widths
    (the same layers, ops and calls; ~no bytes to read): what a step costs beyond reading weights."""
    from suite.infer.engines import ModelEngine
    from suite.models import build_model

    tiny = dataclasses.replace(
        cfg,
        hidden_size=cfg.num_heads * 8,
        head_dim=8 if cfg.head_dim else None,
        ffn_hidden_size=8,
        vocab_size=64,
        max_seq_len=16 + n,
    )
    model = build_model(tiny, "cpu")
    model.init_weights(0)
    engine = ModelEngine(model.eval(), dtype=dtype)
    prompt = [list(range(16))]
    pick = lambda logits: logits.argmax(-1, keepdim=True)  # noqa: E731

    def run(tokens: int) -> float:
        start = time.perf_counter()
        for _ in engine.steps(prompt, tokens, pick):
            pass
        return time.perf_counter() - start

    run(n)
    first = min(run(1) for _ in range(repeats))
    full = min(run(n) for _ in range(repeats))
    return (full - first) / (n - 1)


def matmul_time(model: torch.nn.Module, head, repeats: int = 5) -> float:
    """Seconds of the matmuls of one batch-1 decode step alone: every block projection of the decoder's
    model (as it holds them: fp32 transposed, half stored) on one row, then its head, best of
    `repeats` (the weights stream from memory: together they exceed the caches)."""
    linears = [m for m in model.layers.modules() if type(m) is torch.nn.Linear]
    dtype = linears[0].weight.dtype
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=dtype) for m in linears}
    last = torch.randn(1, 1, model.cfg.hidden_size, dtype=dtype)

    def step() -> None:
        for m in linears:
            torch.nn.functional.linear(rows[m.in_features], m.weight)
        if head is not None:
            head(last, None)
        else:
            torch.nn.functional.linear(last[:, -1], model.output.weight)

    step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best
