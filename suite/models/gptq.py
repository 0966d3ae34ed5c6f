"""GPTQ (Frantar et al., 2022) on plain torch: round-to-nearest's grid, with each weight column's
rounding error compensated on the columns not yet quantized, through the inverse Hessian of the layer's
inputs on calibration data. Runs on CPU and CUDA (torchao's own GPTQ is CUDA only).

    H = X^T X over the calibration tokens (+ compress.gptq_damp * mean diag H on the diagonal)
    for each column j in order:  q_j = round-to-grid(w_j);  e = (w_j - q_j) / [H^-1]_jj
                                  w_k -= e * [H^-1]_jk  for k after j   (upper Cholesky factor of H^-1)

The order is the columns' own (left to right) or, with compress.act_order (the default), decreasing
diag H (GPTQ's act-order, with static groups: each stored group's scale taken from the weight before
compensation, so the integers go back to the weight's column order and the layout is unchanged).
The int4 grid's clipping search (compress.clip_search) can weigh each weight's error by diag H of its
input (compress.clip_weighted, off by default).

The grid is torchao's, so the result is the tensor type round-to-nearest produces and everything
downstream (save, reload, generate, eval) is shared: int4 (`compress=gptq`) is group-wise per
compress.group_size inputs, values in [-8, 7], bf16 scales (IntxUnpackedToInt8Tensor), asymmetric by
default (scale = (max - min) / 15, an integer zero point; compress.symmetric=true: max|w| / 7.5, zero 0); int8 (`compress=gptq-int8`) is symmetric per output row,
scale = max|w| / 127.5, values in [-128, 127] (Int8Tensor). Without act-order, a group's scale is taken from its
columns as they stand when the group starts (after the compensation of the groups before it).

Blocks are quantized in order: the inputs a block's Linear layers see come from the blocks before it
already quantized (as in the paper). Each block's inputs are kept for every calibration batch and
passed on through the quantized block (one forward per block, as the paper's implementation does),
rather than recollected by running the calibration data from the embedding up to each block (quadratic
in the depth: 465 block forwards for 30 layers where caching needs 30).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from suite.models.quantized import quiet_torchao

COLUMN_BLOCK = 128  # columns updated together (the paper's lazy batch updates)


@dataclass(frozen=True)
class Grid:
    """torchao's grid: levels [qmin, qmax], `group` inputs per scale (0: the whole row); symmetric
    (scale = max|w| / ((qmax - qmin) / 2), zero point 0) or asymmetric (scale = (max - min) / (qmax - qmin)
    over the group's range widened to hold 0, integer zero point qmin - round(min / scale), as
    IntxWeightOnlyConfig(mapping_type=ASYMMETRIC) stores it: its zero point comes from the fp32 scale,
    its integers from the scale rounded to `scale_dtype`)."""

    qmin: int
    qmax: int
    group: int
    scale_dtype: torch.dtype
    symmetric: bool = True
    clip: tuple[float, ...] = ()  # asymmetric: shrink factors of the range tried per group (CLIP_SEARCH)
    # clip: each weight's squared error weighted by its input's mean square (diag H, which GPTQ passes
    # as `importance`): the layer's output error, as AWQ's and GPTQModel's MSE searches weigh it
    weighted: bool = False

    def params(
        self, w: torch.Tensor, importance: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale in scale_dtype, zero point as float) of the columns `w` [..., cols] (one group each);
        with `clip`, of the shrunk range whose round trip has the least squared error in each group,
        each column's error times `importance` [..., cols] when given (diag H of those inputs)."""
        if self.clip and not self.symmetric:
            w = w.float()
            best = None
            for factor in self.clip:
                scale, zero = self._range_params(w, factor)
                err = ((self.quantize(w, scale, zero) - zero) * scale.float() - w).pow(2)
                if importance is not None:
                    err = err * importance
                err = err.sum(-1, keepdim=True)
                if best is None:
                    best = [err, scale, zero]
                else:
                    better = err < best[0]
                    best = [torch.where(better, new, old) for new, old in zip((err, scale, zero), best)]
            return best[1], best[2]
        return self._range_params(w, 1.0)

    def _range_params(self, w: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        if self.symmetric:
            amax = w.abs().amax(dim=-1, keepdim=True)
            scale = (amax / ((self.qmax - self.qmin) / 2)).clamp(min=torch.finfo(torch.float32).eps)
            return scale.to(self.scale_dtype), torch.zeros_like(scale)
        low = w.amin(dim=-1, keepdim=True).clamp(max=0.0) * factor
        high = w.amax(dim=-1, keepdim=True).clamp(min=0.0) * factor
        scale = ((high - low) / float(self.qmax - self.qmin)).clamp(
            min=torch.finfo(torch.float32).smallest_normal
        )
        zero = (self.qmin - torch.round(low / scale)).clamp(self.qmin, self.qmax)
        return scale.to(self.scale_dtype), zero

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        """[rows, 1] scale of the columns `w` (one group)."""
        return self.params(w)[0]

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
    ) -> torch.Tensor:
        """torchao's rounding: times the reciprocal, taken in the scale's own dtype, plus the zero point."""
        q = torch.round(w * (1.0 / scale))
        return torch.clamp(q if zero is None else q + zero, self.qmin, self.qmax)

    def round_trip(self, w: torch.Tensor) -> torch.Tensor:
        """`w` [rows, cols] rounded to nearest on this grid and dequantized (fp32)."""
        rows, cols = w.shape
        groups = w.float().reshape(rows, cols // (self.group or cols), -1)
        scale, zero = self.params(groups)
        return ((self.quantize(groups, scale, zero) - zero) * scale.float()).reshape(rows, cols)

    def torchao_config(self) -> Any:
        """The round-to-nearest torchao config with this grid and its tensor type (on any device): int4
        groups as IntxWeightOnlyConfig (bf16 scales), int8 rows as Int8WeightOnlyConfig."""
        quiet_torchao()
        # torchao: a heavy optional dependency, imported when a method runs
        # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, PerGroup

        if self.group:
            mapping = MappingType.SYMMETRIC if self.symmetric else MappingType.ASYMMETRIC
            return IntxWeightOnlyConfig(
                weight_dtype=torch.int4,
                granularity=PerGroup(self.group),
                scale_dtype=self.scale_dtype,
                mapping_type=mapping,
            )
        return Int8WeightOnlyConfig()


INT4_LEVELS = (-8, 7)
# gptq's clipping search (compress.clip_search): a group's range times 1.0, 0.975, ..., 0.8; measured on
# SmolLM2 (docs/benchmarks.md): +15.25% -> +12.72% perplexity over fp32 with the asymmetric grid
CLIP_SEARCH = tuple(1.0 - 0.025 * i for i in range(9))
INT8_LEVELS = (-128, 127)


def int4_grid(
    group_size: int, symmetric: bool = True, clip_search: bool = False, clip_weighted: bool = False
) -> Grid:
    """int4, one bf16 scale (and, asymmetric, an integer zero point) per `group_size` inputs
    (compress=int4 on CPU, gptq, qat-int4); `clip_search`: each group's range shrunk by the CLIP_SEARCH
    factor with the least error (asymmetric only: no longer torchao's round to nearest);
    `clip_weighted`: that error weighted by diag H in GPTQ (compress.clip_weighted)."""
    clip = CLIP_SEARCH if clip_search else ()
    return Grid(*INT4_LEVELS, group_size, torch.bfloat16, symmetric, clip, clip_weighted and clip_search)


def int8_grid() -> Grid:
    """Symmetric int8, one fp32 scale per output row (compress=int8, gptq-int8, qat-int8)."""
    return Grid(*INT8_LEVELS, 0, torch.float32)


@torch.no_grad()
def gptq_weight(
    weight: torch.Tensor, hessian: torch.Tensor, grid: Grid, damp: float, act_order: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(integer values [out, in] as int8, scales [out, groups], integer zero points [out, groups] as
    int8: 0 on a symmetric grid) of `weight` [out, in] given H [in, in], all in the weight's own
    column order.

    `act_order` (GPTQ's desc_act): columns are rounded in order of decreasing diag H, so the inputs
    that matter most are rounded while the most columns are left to absorb their error; the groups
    stay the stored ones (consecutive inputs) and their scales and zero points are taken from the
    weight before any compensation (AutoGPTQ's static_groups), so the tensor type and layout are
    unchanged. Without it, a group's scale comes from its columns as compensated when it starts."""
    w = weight.detach().float().clone()
    rows, cols = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs never active: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    importance = torch.diag(h).float()  # each input's sum of squares: its weights' cost per unit error
    weights_of = importance if grid.weighted else None
    group = grid.group or cols
    scales = torch.zeros(rows, cols // group, dtype=grid.scale_dtype, device=w.device)
    zeros = torch.zeros(rows, cols // group, device=w.device)
    order = None
    if act_order:
        order = torch.argsort(importance, descending=True, stable=True)
        scale, zero = grid.params(
            w.reshape(rows, cols // group, group),
            None if weights_of is None else weights_of.reshape(cols // group, group),
        )
        scales.copy_(scale.reshape(rows, cols // group))
        zeros.copy_(zero.reshape(rows, cols // group))
        w, h = w[:, order], h[order][:, order]
    # the stored group of each column in the order rounded
    groups = ((order.cpu() if order is not None else torch.arange(cols)) // group).tolist()
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=h.dtype, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    q = torch.zeros_like(w)
    for start in range(0, cols, COLUMN_BLOCK):
        end = min(start + COLUMN_BLOCK, cols)
        w1, err = w[:, start:end].clone(), torch.zeros(rows, end - start, device=w.device)
        h1 = hinv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            g = groups[col]
            if order is None and col % group == 0:  # its group's scale, from its columns as they stand
                ahead = torch.cat([w1[:, i:], w[:, end:]], dim=1)[:, :group]
                its = None if weights_of is None else weights_of[col : col + group]
                scales[:, g : g + 1], zeros[:, g : g + 1] = grid.params(ahead, its)
            scale, zero = scales[:, g : g + 1], zeros[:, g : g + 1]
            qcol = grid.quantize(w1[:, i : i + 1], scale, zero)
            q[:, col] = qcol[:, 0]
            e = (w1[:, i] - ((qcol - zero) * scale.float())[:, 0]) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err[:, i] = e
        w[:, end:] -= err @ hinv[start:end, end:]
    if order is not None:  # back to the weight's own column order
        q = q[:, torch.argsort(order)]
    return q.to(torch.int8), scales, zeros.to(torch.int8)


class _Stop(Exception):
    """Raised by the hook after the block being calibrated: the rest of the forward is not needed."""


@torch.no_grad()
def input_hessians(
    linears: dict[str, nn.Linear], run: Callable[[], None], stop_after: nn.Module | None
) -> dict[str, torch.Tensor]:
    """X^T X of each Linear's input over the calibration forwards (`run`); each forward raises _Stop
    after `stop_after` (None: runs to the end)."""
    hessians: dict[str, torch.Tensor] = {}

    def on_input(name: str):
        def hook(module, args):
            x = args[0].detach().flatten(0, -2).float()
            h = x.t() @ x
            hessians[name] = h if name not in hessians else hessians[name] + h

        return hook

    def stop(module, args, output):
        raise _Stop

    handles = [m.register_forward_pre_hook(on_input(n)) for n, m in linears.items()]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(stop))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return hessians


def _stages(model: nn.Module, targets: list[str]) -> list[tuple[nn.Module | None, list[str]]]:
    """Targets grouped by the transformer block holding them, in order; the rest (e.g. an untied head) last."""
    blocks = getattr(model, "layers", None)
    stages, placed = [], set()
    if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
        for key, block in items:
            prefix = f"layers.{key}."
            names = [t for t in targets if t.startswith(prefix)]
            if names:
                stages.append((block, names))
                placed.update(names)
    rest = [t for t in targets if t not in placed]
    if rest:
        stages.append((None, rest))
    return stages


def _blocks(model: nn.Module) -> list[nn.Module] | None:
    """The transformer blocks in the order the forward runs them (None: the model has no `layers`)."""
    blocks = getattr(model, "layers", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return None


BlockInputs = list[tuple[tuple[Any, ...], dict[str, Any]]]


@torch.no_grad()
def first_block_inputs(
    model: nn.Module, block: nn.Module, calibrate: Callable[[nn.Module], None]
) -> BlockInputs:
    """(args, kwargs) the first block receives for each calibration forward, which stops there."""
    captured: BlockInputs = []

    def hook(module, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    def forward_until_stop(*args, **kwargs):
        try:
            return model(*args, **kwargs)
        except _Stop:
            return None

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        calibrate(forward_until_stop)
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def sensitivity(
    model: nn.Module, targets: list[str], grid: Grid, calibrate: Callable[[nn.Module], None]
) -> dict[str, float]:
    """How much each Linear in `targets` suffers on `grid`, measured on the calibration data: the
    relative output error of round to nearest, tr(dW H dW^T) / tr(W H W^T) with H = X^T X of the
    layer's float inputs (one whole-model calibration pass). GPTQ then keeps the highest at int8."""
    modules = dict(model.named_modules())
    hessians = input_hessians({n: modules[n] for n in targets}, lambda: calibrate(model), None)
    scores = {}
    for name in targets:
        h = hessians.pop(name, None)
        if h is None:
            scores[name] = 0.0
            continue
        w = modules[name].weight.detach().float()
        delta = w - grid.round_trip(w)
        scores[name] = float(((delta @ h) * delta).sum() / ((w @ h) * w).sum().clamp(min=1e-30))
    return scores


def _quantize_linears(
    linears: dict[str, nn.Linear],
    hessians: dict[str, torch.Tensor],
    grid: Grid | Callable[[str], Grid],
    damp: float,
    results: dict[str, tuple[torch.Tensor, ...]],
    act_order: bool = False,
) -> None:
    """GPTQ each Linear on its Hessian (on `grid`, or `grid(name)`; `act_order`: gptq_weight's); its
    weight becomes the dequantized result, so what runs after it sees quantized outputs."""
    for name, linear in linears.items():
        h = hessians.get(name)
        if h is None:
            h = torch.zeros(linear.in_features, linear.in_features, device=linear.weight.device)
        its = grid(name) if callable(grid) else grid
        q, scales, zeros = gptq_weight(linear.weight, h, its, damp, act_order)
        results[name] = (q, scales, zeros)
        group = its.group or linear.in_features
        dequant = (
            q.float() - zeros.float().repeat_interleave(group, dim=1)
        ) * scales.float().repeat_interleave(group, dim=1)
        linear.weight.copy_(dequant.to(linear.weight.dtype))


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats to zero now (torch has a setter, no getter: a probe)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.5).item() == 0.0


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Denormal floats flushed to zero inside, the caller's setting restored after. GPTQ's per-column
    updates of real weights wander into the denormal range, where the CPU's slow path cost one SmolLM2
    weight 4.0 s instead of 1.7 s (the same integers); torch's switch is thread-global, so the rest of
    the process (training, eval) must not inherit it."""
    before = flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@flush_denormals()
@torch.no_grad()
def gptq_quantize(
    model: nn.Module,
    targets: list[str],
    grid: Grid,
    damp: float,
    calibrate: Callable[[nn.Module], None],
    cache_inputs: bool = True,
    progress: bool = False,
    int8_layers: Iterable[str] = (),
    act_order: bool = False,
) -> None:
    """Quantize the Linear layers `targets` of `model` in place with GPTQ on `grid`, to the tensor types
    torchao's round-to-nearest gives for the same grid (`compress=int4` / `int8` on CPU).

    `cache_inputs` (when the model runs its blocks one after another, `model.layers`): each block's
    inputs for every calibration batch are kept, so a block runs twice (its Hessians, then its quantized
    outputs: the next block's inputs) instead of the whole model up to it once per block; the same
    tensors reach every Linear, so the result is the same. Without it (or without `layers`), each
    block's inputs come from a forward from the embedding that stops after the block. What is not in a
    block (an untied head) is calibrated by one whole forward at the end. `progress`: a bar on stderr.
    `int8_layers`: targets quantized on the int8 grid instead (mixed precision: `sensitivity`).
    `act_order`: columns rounded in order of decreasing diag H (gptq_weight).
    """
    # deferred: tqdm (transformers' dependency) draws the bar only when asked for
    from tqdm import tqdm

    modules = dict(model.named_modules())
    results: dict[str, tuple[torch.Tensor, ...]] = {}
    wide = set(int8_layers)
    eight = int8_grid()

    def layer_grid(name: str) -> Grid:
        return eight if name in wide else grid

    stages = _stages(model, targets)
    blocks = _blocks(model) if cache_inputs else None
    bar = tqdm(total=len(stages), desc="GPTQ", unit="block", file=sys.stderr, disable=not progress)

    def forward_until_stop(*args, **kwargs):  # each calibration batch's forward ends at the stop
        try:
            return model(*args, **kwargs)
        except _Stop:
            return None

    if blocks:
        by_block = {id(block): names for block, names in stages if block is not None}
        inputs = first_block_inputs(model, blocks[0], calibrate)
        last = max(i for i, block in enumerate(blocks) if id(block) in by_block) if by_block else -1
        for i, block in enumerate(blocks[: last + 1]):
            names = by_block.get(id(block))
            if names:
                linears = {n: modules[n] for n in names}
                hessians = input_hessians(linears, lambda b=block, x=inputs: [b(*a, **k) for a, k in x], None)
                _quantize_linears(linears, hessians, layer_grid, damp, results, act_order)
                bar.update()
            if i < last:  # the next block's inputs: this one's outputs, quantized
                inputs = [((block(*args, **kwargs), *args[1:]), kwargs) for args, kwargs in inputs]
        del inputs
        stages = [(block, names) for block, names in stages if block is None]
    for block, names in stages:
        linears = {n: modules[n] for n in names}
        hessians = input_hessians(linears, lambda: calibrate(forward_until_stop), block)
        _quantize_linears(linears, hessians, layer_grid, damp, results, act_order)
        bar.update()
    bar.close()
    store_values(model, [t for t in targets if t not in wide], grid, results)
    if wide:
        store_values(model, [t for t in targets if t in wide], eight, results)


def store_values(
    model: nn.Module, targets: list[str], grid: Grid, values: dict[str, tuple[torch.Tensor, ...]]
) -> None:
    """`targets` converted to `grid`'s torchao tensor type and layout (round to nearest), then the
    layers in `values` given those integers, scales (and zero points, when a value has a third entry)
    instead (GPTQ's, or QAT's learned grid)."""
    quiet_torchao()
    # torchao: a heavy optional dependency, imported when a method runs
    # deferred: torchao (seconds to import, with its own warnings) loads only where a quantized model is built
    from torchao.quantization import quantize_

    modules = dict(model.named_modules())
    wanted = set(targets)
    quantize_(model, grid.torchao_config(), lambda m, n: n in wanted)
    for name, value in values.items():
        if name not in wanted:
            continue
        linear = modules[name]
        linear.weight = nn.Parameter(with_values(linear.weight, *value), requires_grad=False)


def with_values(like, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None):
    """A tensor of `like`'s torchao type and attributes holding GPTQ's integers and scales (and integer
    zero points; None: `like`'s, 0 on a symmetric grid)."""
    fields = {n: getattr(like, n) for n in like.tensor_data_names + like.tensor_attribute_names}
    for n in getattr(like, "optional_tensor_data_names", []) + getattr(
        like, "optional_tensor_attribute_names", []
    ):
        fields[n] = getattr(like, n, None)
    if tuple(fields["qdata"].shape) != tuple(q.shape) or fields["scale"].numel() != scales.numel():
        raise AssertionError(
            f"torchao's layout changed: qdata {tuple(fields['qdata'].shape)}, scale {tuple(fields['scale'].shape)}"
        )
    fields["qdata"] = q.to(fields["qdata"].dtype).to(fields["qdata"].device)
    fields["scale"] = (
        scales.reshape(fields["scale"].shape).to(fields["scale"].dtype).to(fields["scale"].device)
    )
    if zeros is not None and "zero_point" in fields:
        zp = fields["zero_point"]
        fields["zero_point"] = zeros.reshape(zp.shape).to(zp.dtype).to(zp.device)
    elif zeros is not None and zeros.any():
        raise AssertionError(f"{type(like).__name__} holds no zero point for nonzero zero points")
    return type(like)(**fields)
