"""Tensors not read yet, so checkpoints convert and load one tensor (or one shard) at a time.

A `LazyTensor` knows its shape and dtype and can read any box of itself (`read(box)`, one
(start, stop) pair per dim) from where it lives: a safetensors file (a slice read, nothing else),
a DCP checkpoint (one tensor), or memory. The weight-name mappings of suite.export.hf run
unchanged on lazy tensors: `.t()`, `.transpose`, `.split`, `.chunk`, `.narrow`, `.select`,
`torch.cat` and `torch.stack` stay lazy and read only the part of each source that a box needs,
so a rank of a sharded run reads just its own shard of every HF tensor. Any other operation is
deferred as well (its shape worked out on the meta device) and reads its inputs whole when read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


class LazyTensor:
    """Shape, dtype and `read(box)`; subclasses say how a box is read."""

    shape: torch.Size
    dtype: torch.dtype

    def read(self, box: Box | None = None) -> torch.Tensor:
        box = full_box(self.shape) if box is None else tuple(box)
        if len(box) != len(self.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, self.shape)):
            raise IndexError(f"box {box} does not fit a tensor of shape {tuple(self.shape)}")
        return self._read(box)

    def _read(self, box: Box) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define _read")

    # ---- the operations the weight mappings use ---------------------------------------------------
    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def contiguous(self) -> LazyTensor:
        return self

    def transpose(self, dim0: int, dim1: int) -> LazyTensor:
        return _Transposed(self, dim0 % self.dim(), dim1 % self.dim())

    def t(self) -> LazyTensor:
        return self.transpose(0, 1) if self.dim() == 2 else self

    @property
    def T(self) -> LazyTensor:  # noqa: N802 (torch's name)
        return self.t()

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return _Narrowed(self, dim % self.dim(), start, length)

    def select(self, dim: int, index: int) -> LazyTensor:
        return _Selected(self, dim % self.dim(), index % self.shape[dim % self.dim()])

    def reshape(self, *shape) -> LazyTensor:
        """Merging dims 0 and 1 (interleaved rows, as fuse_gate_up makes) stays lazy; any other
        reshape is deferred."""
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if self.dim() >= 2:
            merged = (self.shape[0] * self.shape[1], *self.shape[2:])
            if len(shape) == len(merged) and all(n in (m, -1) for n, m in zip(shape, merged)):
                return _MergedLeading(self)
        return _deferred_call(torch.Tensor.reshape, (self, shape), {})

    view = reshape

    def __getitem__(self, index) -> LazyTensor:
        if isinstance(index, int):
            return self.select(0, index)
        return _Deferred(lambda t: t[index], [self])

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple[LazyTensor, ...]:
        dim %= self.dim()
        n = self.shape[dim]
        sizes = list(split_size) if not isinstance(split_size, int) else [split_size] * -(-n // split_size)
        if isinstance(split_size, int) and sizes:
            sizes[-1] = n - split_size * (len(sizes) - 1)
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to {n}")
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow(dim, start, size))
            start += size
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyTensor, ...]:
        n = self.shape[dim % self.dim()]
        return self.split(-(-n // chunks), dim)

    def __getattr__(self, name: str):
        """Any other tensor method: deferred, its inputs read whole when the result is read."""
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        return lambda *args, **kwargs: _deferred_call(getattr(torch.Tensor, name), (self, *args), kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat or func is torch.concat:
            tensors, dim = _tensors_and_dim(args, kwargs)
            return _Concatenated([as_lazy(t) for t in tensors], dim)
        if func is torch.stack:
            tensors, dim = _tensors_and_dim(args, kwargs)
            return _Stacked([as_lazy(t) for t in tensors], dim)
        return _deferred_call(func, args, kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


def _tensors_and_dim(args, kwargs) -> tuple[list, int]:
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return tensors, dim


def as_lazy(value: torch.Tensor | LazyTensor) -> LazyTensor:
    return value if isinstance(value, LazyTensor) else InMemory(value)


class InMemory(LazyTensor):
    """A tensor that is already in memory (a model's state dict, a computed value)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype

    def _read(self, box: Box) -> torch.Tensor:
        return self.tensor[tuple(slice(a, b) for a, b in box)]


class Source(LazyTensor):
    """A stored tensor: `reader(box)` returns that box (a safetensors slice, a DCP read)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, reader: Callable[[Box], torch.Tensor]):
        self.shape, self.dtype, self.reader = torch.Size(shape), dtype, reader

    def _read(self, box: Box) -> torch.Tensor:
        return self.reader(box)


class _Transposed(LazyTensor):
    def __init__(self, src: LazyTensor, dim0: int, dim1: int):
        self.src, self.dims, self.dtype = src, (dim0, dim1), src.dtype
        shape = list(src.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape = torch.Size(shape)

    def _read(self, box: Box) -> torch.Tensor:
        d0, d1 = self.dims
        inner = list(box)
        inner[d0], inner[d1] = inner[d1], inner[d0]
        return self.src.read(tuple(inner)).transpose(d0, d1)


class _Narrowed(LazyTensor):
    def __init__(self, src: LazyTensor, dim: int, start: int, length: int):
        if not 0 <= start <= start + length <= src.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) of shape {tuple(src.shape)}")
        self.src, self.dim_, self.start, self.dtype = src, dim, start, src.dtype
        shape = list(src.shape)
        shape[dim] = length
        self.shape = torch.Size(shape)

    def _read(self, box: Box) -> torch.Tensor:
        inner = list(box)
        a, b = inner[self.dim_]
        inner[self.dim_] = (a + self.start, b + self.start)
        return self.src.read(tuple(inner))


class _Selected(LazyTensor):
    def __init__(self, src: LazyTensor, dim: int, index: int):
        self.src, self.dim_, self.index, self.dtype = src, dim, index, src.dtype
        self.shape = torch.Size(s for i, s in enumerate(src.shape) if i != dim)

    def _read(self, box: Box) -> torch.Tensor:
        inner = list(box)
        inner.insert(self.dim_, (self.index, self.index + 1))
        return self.src.read(tuple(inner)).squeeze(self.dim_)


class _MergedLeading(LazyTensor):
    """src.reshape(src.shape[0] * src.shape[1], *rest): reads the whole rows of dim 0 it spans."""

    def __init__(self, src: LazyTensor):
        self.src, self.dtype = src, src.dtype
        self.shape = torch.Size((src.shape[0] * src.shape[1], *src.shape[2:]))

    def _read(self, box: Box) -> torch.Tensor:
        (a, b), rest = box[0], box[1:]
        inner = self.src.shape[1]
        first, last = a // inner, -(-b // inner)
        rows = self.src.read(((first, last), (0, inner), *rest))
        return rows.reshape(-1, *rows.shape[2:])[a - first * inner : b - first * inner]


class _Concatenated(LazyTensor):
    def __init__(self, parts: list[LazyTensor], dim: int):
        self.parts, self.dim_ = parts, dim % parts[0].dim()
        self.dtype = parts[0].dtype
        shape = list(parts[0].shape)
        shape[self.dim_] = sum(p.shape[self.dim_] for p in parts)
        self.shape = torch.Size(shape)

    def _read(self, box: Box) -> torch.Tensor:
        a, b = box[self.dim_]
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim_]
            lo, hi = max(a, offset), min(b, offset + size)
            if lo < hi or (size == 0 and not pieces):
                inner = list(box)
                inner[self.dim_] = (lo - offset, hi - offset) if lo < hi else (0, 0)
                pieces.append(part.read(tuple(inner)))
            offset += size
        return torch.cat(pieces, dim=self.dim_) if len(pieces) > 1 else pieces[0]


class _Stacked(LazyTensor):
    def __init__(self, parts: list[LazyTensor], dim: int):
        self.parts, self.dim_ = parts, dim % (parts[0].dim() + 1)
        self.dtype = parts[0].dtype
        shape = list(parts[0].shape)
        shape.insert(self.dim_, len(parts))
        self.shape = torch.Size(shape)

    def _read(self, box: Box) -> torch.Tensor:
        inner = list(box)
        a, b = inner.pop(self.dim_)
        pieces = [self.parts[i].read(tuple(inner)) for i in range(a, b)]
        if not pieces:
            return torch.empty([hi - lo for lo, hi in box], dtype=self.dtype)
        return torch.stack(pieces, dim=self.dim_)


class _Deferred(LazyTensor):
    """fn(*inputs read whole): for operations that have no lazy form."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: list[LazyTensor]):
        self.fn, self.inputs = fn, inputs
        meta = fn(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs))
        self.shape, self.dtype = meta.shape, meta.dtype

    def _read(self, box: Box) -> torch.Tensor:
        value = self.fn(*(t.read() for t in self.inputs))
        return value[tuple(slice(a, b) for a, b in box)]


def _deferred_call(func, args, kwargs):
    """func(*args, **kwargs) with every LazyTensor argument (also inside lists) read when needed."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    lazy_at = [i for i, v in enumerate(flat) if isinstance(v, LazyTensor)]
    inputs = [flat[i] for i in lazy_at]

    def call(*tensors):
        values = list(flat)
        for i, t in zip(lazy_at, tensors):
            values[i] = t
        a, k = torch.utils._pytree.tree_unflatten(values, spec)
        return func(*a, **k)

    meta = call(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs))
    if isinstance(meta, torch.Tensor):
        return _Deferred(call, inputs)
    if isinstance(meta, (tuple, list)) and all(isinstance(m, torch.Tensor) for m in meta):
        return tuple(_Deferred(lambda *t, i=i: call(*t)[i], inputs) for i in range(len(meta)))
    return call(*(t.read() for t in inputs))  # not a tensor (a shape, a bool): answer now
