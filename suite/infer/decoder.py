"""Batched decoding with a static KV cache: what `suite generate` runs on suite models.

Prompts of different lengths are left-padded into one batch. The cache holds [batch, kv heads,
max_len, head_dim] per layer; step t writes column t for every row. A compiled step
(`torch.compile`, generate.compile) attends the whole buffer under a mask (a row's padding and the
columns not written yet are masked out), so every step has the same shapes and one compiled step
serves the whole generation; an eager step attends only the columns written so far (a view, no copy). Positions are per row (the padding is not counted), so a padded row decodes exactly as it
would alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
import torch._inductor.config as inductor_config

from suite.config.errors import ConfigError
from suite.infer.decode_layout import decode_layout, relayable
from suite.models.transformer import Transformer, cache_dims
from suite.runtime import DTYPES


class StaticKVCache:
    """Fixed-size per-layer buffers written at `slot` (a tensor of columns, not a Python count, so a
    compiled step does not specialise on the position)."""

    length = 0  # the model's `start`: positions and masks come from the decoder, not from a count
    # eager decoding attends only the columns written so far (`visible`), so a step costs what the
    # sequence so far costs, not what the whole buffer does; a compiled step keeps the full buffer
    # (None) so its shapes never change
    visible: int | None = None

    def __init__(self, model: Transformer, batch: int, max_len: int):
        p = next(model.parameters())
        dims = cache_dims(model)
        self.keys = [p.new_zeros((batch, k[0], max_len, k[1])) for k, _ in dims]
        self.values = [p.new_zeros((batch, v[0], max_len, v[1])) for _, v in dims]
        self.slot = torch.zeros(1, dtype=torch.long, device=p.device)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        self.keys[layer].index_copy_(2, self.slot, k)
        self.values[layer].index_copy_(2, self.slot, v)
        if self.visible is None:
            return self.keys[layer], self.values[layer]
        return self.keys[layer][:, :, : self.visible], self.values[layer][:, :, : self.visible]

    def advance(self, tokens: int) -> None:
        pass  # the decoder moves `slot`


def _decode_step(
    model: Transformer,
    cache: StaticKVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    head: Callable | None = None,
) -> torch.Tensor:
    if head is not None:  # the model hands its final hidden states to `head` (its forward's `head`)
        return model(tokens, positions=positions, mask=mask, kv_cache=cache, head=head)
    return model(tokens, positions=positions, mask=mask, kv_cache=cache)[:, -1].float()


class LastTokenHead:
    """The output projection of the last position only, in the form the CPU's matmul streams fastest.

    The head is the largest matrix a small model reads per token, and by the time it is read the
    blocks have pushed it out of the caches. Measured on the 2-core AMD EPYC (fp32, the weight evicted
    by 12 MB of other reads before each call, vocabulary 8192 / 32000 x hidden 256): one row runs
    fastest as `x @ W^T` against a contiguous transposed copy (540 / 2,206 us; against the stored
    [vocab, hidden] weight 953 / 4,391 us); from two rows on, `W @ x^T` with the weight as stored
    (8 rows: 827 / 4,578 us against the copy's 1,393 / 6,712 us), where the library streams the big
    matrix once instead of repacking it. The two forms agree up to rounding (~4e-5 of the logits at
    width 256), so a prompt decoded alone and in a batch take the same tokens unless two logits tie
    that closely. Used by eager decoding of a plain nn.Linear head (not quantized, no adapters); costs
    one more copy of the head's weight."""

    def __init__(self, output: torch.nn.Linear):
        self.weight = output.weight.detach()
        self.weight_t = self.weight.t().contiguous()
        self.bias = None if output.bias is None else output.bias.detach()

    @staticmethod
    def applies(model: Transformer) -> bool:
        output = getattr(model, "output", None)
        return (
            type(output) is torch.nn.Linear
            and type(output.weight) is torch.nn.Parameter
            and output.weight.device.type == "cpu"
            and output.weight.dtype == torch.float32  # half weights: the model's own head (F.linear)
        )

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        last = hidden[:, -1]
        logits = last @ self.weight_t if last.shape[0] == 1 else (self.weight @ last.t()).t()
        return (logits if self.bias is None else logits + self.bias).float()


def _frozen(compiled: Callable) -> Callable:
    """Compile (at the first call) with inductor's freezing on, without changing it for the process."""

    def step(*args):
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return step


def _in_precision(model: Transformer, dtype: torch.dtype, owns_model: bool) -> Transformer:
    """`model` with its floating-point tensors in `dtype` (a copy unless the decoder owns it)."""
    if dtype == torch.float32:
        return model
    if not relayable(model):
        raise ConfigError(
            f"generate.dtype={ {v: k for k, v in DTYPES.items()}[dtype] }: only plain dense models on CPU decode "
            "in half precision (not quantized, adapter, expert or GPU models); use generate.dtype=fp32"
        )
    inv_freq = model.rope_inv_freq.float().clone() if model.rope_inv_freq is not None else None
    half = (model if owns_model else copy.deepcopy(model)).to(dtype)
    if inv_freq is not None:  # RoPE's frequencies stay fp32: rounded to half, far positions' angles drift
        half.rope_inv_freq = inv_freq
    return half


class BatchDecoder:
    """Prefill a left-padded batch once, then one token per row per step from the static cache."""

    def __init__(
        self,
        model: Transformer,
        compile: bool = False,
        owns_model: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        """owns_model: nobody else uses `model`, so eager decoding may relay it in place (no copy).
        dtype (generate.dtype): bf16/fp16 decode with the weights, activations and cache in that
        precision (half the bytes read per token; torch's CPU half matmuls accumulate in fp32)."""
        self.grow = not compile
        model = _in_precision(model, dtype, owns_model)
        owns_model = owns_model or dtype != torch.float32
        # eager: the layout the CPU streams fastest (suite.infer.decode_layout; the model itself elsewhere)
        self.model = decode_layout(model.eval(), in_place=owns_model) if self.grow else model.eval()
        model = self.model
        # freezing: the weights become constants, so inductor packs them for oneDNN's matmuls (on CPU
        # 1.2x the eager step at batch 1, the same at batch 8, bench/generate.py); the model must not
        # change after
        self.step_fn: Callable = (
            _frozen(torch.compile(_decode_step, fullgraph=True)) if compile else _decode_step
        )
        self.head = LastTokenHead(model.output) if self.grow and LastTokenHead.applies(model) else None

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, pick: Callable
    ) -> Iterator[torch.Tensor]:
        """Yield each step's next tokens [b] (pick(logits [b, vocab]) -> [b, 1]); the caller stops it."""
        model, device = self.model, next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        total = width + max_new_tokens
        batch = len(prompts)
        pad = torch.tensor([width - len(p) for p in prompts], device=device)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        for row, ids in enumerate(prompts):
            tokens[row, width - len(ids) :] = torch.tensor(ids, device=device)
        cache = StaticKVCache(model, batch, total)
        columns = torch.arange(total, device=device)
        key_valid = columns[None, :] >= pad[:, None]  # [b, total]: a row's padding is never attended

        # prefill: columns 0 .. width-1; a padding query attends to itself only (no empty softmax row)
        query = columns[:width]
        causal = columns[None, :] <= query[:, None]  # [width, total]
        mask = causal[None] & (key_valid[:, None, :] | (columns[None, None, :] == query[None, :, None]))
        positions = (query[None, :] - pad[:, None]).clamp(min=0)
        cache.slot = query
        # eager, no row padded: causal prefill and unmasked steps (sdpa runs ~2x faster without a mask)
        unmasked = self.grow and not bool((pad > 0).any())
        if self.grow:
            cache.visible, mask = width, mask[..., :width]
        mask = None if unmasked else mask[:, None]
        logits = _decode_step(model, cache, tokens, positions, mask, self.head)
        for t in range(width, total):
            token = pick(logits)
            yield token[:, 0]
            if t == total - 1:
                return
            cache.slot = columns[t : t + 1]
            step_mask = None
            if not unmasked:
                step_mask = (key_valid & (columns[None, :] <= t))[:, None, None, :]
            if self.grow:
                cache.visible = t + 1
                step_mask = None if step_mask is None else step_mask[..., : t + 1]
                logits = _decode_step(model, cache, token, (t - pad)[:, None], step_mask, self.head)
            else:
                logits = self.step_fn(model, cache, token, (t - pad)[:, None], step_mask)
