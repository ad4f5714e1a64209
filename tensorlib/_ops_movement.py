"""Movement primitives: reshape, transpose, broadcast, indexing, concatenate, stack."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._autograd import Function
from ._ops_elementwise import xp_of

__all__ = [
    "BroadcastTo",
    "Concatenate",
    "Getitem",
    "Reshape",
    "Stack",
    "Transpose",
    "norm_perm",
    "normalize_index",
]


def norm_perm(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    """Check that ``axes`` is a permutation of ``range(ndim)`` (negatives allowed)."""
    if len(axes) != ndim:
        raise ValueError(f"transpose: axes {tuple(axes)} do not match a tensor with {ndim} dims")
    out = []
    for a in axes:
        if not isinstance(a, int | np.integer) or not -ndim <= a < ndim:
            raise ValueError(f"transpose: axis {a!r} out of range for {ndim} dims")
        out.append(int(a) % ndim)
    if sorted(out) != list(range(ndim)):
        raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation")
    return tuple(out)


def normalize_index(index: Any, device: Any = None) -> Any:
    """Replace Tensors inside an index by their arrays; lists become integer/bool arrays.

    With a CUDA ``device``, host index arrays are copied to it so CuPy can use them.
    """
    from ._tensor import Tensor

    to_gpu = device is not None and device.type == "cuda"

    def one(i: Any) -> Any:
        if isinstance(i, Tensor):
            i = i._data
        elif isinstance(i, list):
            i = np.asarray(i)
        if to_gpu and isinstance(i, np.ndarray):
            with device:  # Why: asarray copies to the *current* GPU, which may be another one
                i = device.xp.asarray(i)
        return i

    if isinstance(index, tuple):
        return tuple(one(i) for i in index)
    return one(index)


def _has_int_array(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    for p in parts:
        kind = getattr(getattr(p, "dtype", None), "kind", None)
        if kind in ("i", "u"):
            return True
    return False


class Reshape(Function):
    __slots__ = ("shape",)

    def forward(self, a: Any, shape: tuple[int, ...] = ()) -> Any:
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, g: Any) -> Any:
        return g.reshape(self.shape)


class Transpose(Function):
    __slots__ = ("inv",)

    def forward(self, a: Any, axes: tuple[int, ...] = ()) -> Any:
        self.inv = tuple(int(i) for i in np.argsort(axes))
        return a.transpose(axes)

    def backward(self, g: Any) -> Any:
        return g.transpose(self.inv)


class BroadcastTo(Function):
    __slots__ = ()

    def forward(self, a: Any, shape: tuple[int, ...] = ()) -> Any:
        return xp_of(a).broadcast_to(a, shape)

    def backward(self, g: Any) -> Any:
        return g  # the engine sums it back to the input's shape


class Getitem(Function):
    __slots__ = ("dtype", "index", "shape")

    def forward(self, a: Any, index: Any = None) -> Any:
        self.shape, self.dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, g: Any) -> Any:
        xp = xp_of(g)
        grad = xp.zeros(self.shape, dtype=self.dtype)
        index = self.index
        if _has_int_array(index):
            # Repeated integer indices must add up (add.at), not overwrite.
            if xp is np:
                np.add.at(grad, index, g)
            elif hasattr(xp, "add_at"):  # a registered device kind's (remote) NumPy-like module
                xp.add_at(grad, index, g)
            else:
                import cupyx

                cupyx.scatter_add(grad, index, g)
        else:
            grad[index] = g
        return grad


def _xp_of_all(arrays: tuple[Any, ...], verb: str) -> Any:
    """The array module (NumPy or CuPy) for joining ``arrays``; at least one is required."""
    if not arrays:
        raise ValueError(f"need at least one tensor to {verb}")
    return xp_of(next(a for a in arrays if hasattr(a, "shape")))


class Concatenate(Function):
    __slots__ = ("axis", "sizes")
    promote_from = 0

    def forward(self, *arrays: Any, axis: int = 0) -> Any:
        out = _xp_of_all(arrays, "concatenate").concatenate(arrays, axis=axis)
        self.axis = axis % out.ndim
        self.sizes = [a.shape[self.axis] for a in arrays]
        return out

    def backward(self, g: Any) -> Any:
        grads = []
        start = 0
        lead = (slice(None),) * self.axis
        for n, inp in zip(self.sizes, self.inputs, strict=True):
            grads.append(g[(*lead, slice(start, start + n))] if inp is not None else None)
            start += n
        return tuple(grads)


class Stack(Function):
    __slots__ = ("axis",)
    promote_from = 0

    def forward(self, *arrays: Any, axis: int = 0) -> Any:
        out = _xp_of_all(arrays, "stack").stack(arrays, axis=axis)
        self.axis = axis % out.ndim
        return out

    def backward(self, g: Any) -> Any:
        lead = (slice(None),) * self.axis
        return tuple(
            g[(*lead, i)] if inp is not None else None for i, inp in enumerate(self.inputs)
        )
