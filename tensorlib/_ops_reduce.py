"""Reduction primitives: sum, mean, max, min over axes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._autograd import Function
from ._ops_elementwise import xp_of

__all__ = ["Max", "Mean", "Min", "Sum", "norm_axis"]


def norm_axis(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...] | None:
    """Normalize ``axis`` to a sorted tuple of non-negative axes (None means all)."""
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int):
            raise TypeError(f"axis must be an int or a sequence of ints, got {axis!r}")
        if not -ndim <= a < max(ndim, 1):
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimension(s)")
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axis in {axis!r}")
    return tuple(sorted(out))


def _expand(g: Any, shape: tuple[int, ...], axis: tuple[int, ...] | None, keepdims: bool) -> Any:
    """Reshape a reduced gradient so it broadcasts against the input's shape."""
    if not keepdims:
        if axis is None:
            g = g.reshape((1,) * len(shape))
        else:
            g = xp_of(g).expand_dims(g, axis)
    return g


class Sum(Function):
    __slots__ = ("axis", "keepdims", "shape")
    autocast = "float32"

    def forward(self, a: Any, axis: tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        self.shape, self.axis, self.keepdims = a.shape, axis, keepdims
        return a.sum(axis=axis, keepdims=keepdims)

    def backward(self, g: Any) -> Any:
        g = _expand(g, self.shape, self.axis, self.keepdims)
        return xp_of(g).broadcast_to(g, self.shape)


class Mean(Function):
    __slots__ = ("axis", "keepdims", "shape")

    def forward(self, a: Any, axis: tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        self.shape, self.axis, self.keepdims = a.shape, axis, keepdims
        return a.mean(axis=axis, keepdims=keepdims)

    def backward(self, g: Any) -> Any:
        shape = self.shape
        n = 1
        for ax in self.axis if self.axis is not None else range(len(shape)):
            n *= shape[ax]
        g = _expand(g, shape, self.axis, self.keepdims) * (1.0 / max(n, 1))
        return xp_of(g).broadcast_to(g, shape)


class _Extreme(Function):
    __slots__ = ("a", "axis", "keepdims", "out")
    _fn = "max"

    def forward(self, a: Any, axis: tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        if a.size == 0:
            raise ValueError(f"{self._fn}() of an empty tensor of shape {tuple(a.shape)}")
        out = getattr(a, self._fn)(axis=axis, keepdims=True)
        self.a, self.out, self.axis, self.keepdims = a, out, axis, keepdims
        if keepdims:
            return out
        return out.reshape(()) if axis is None else out.squeeze(axis)

    def backward(self, g: Any) -> Any:
        xp = xp_of(g)
        g = _expand(g, self.a.shape, self.axis, self.keepdims)
        mask = self.a == self.out
        # Ties share the gradient equally (the subgradient with the smallest norm).
        count = mask.sum(axis=self.axis, keepdims=True).astype(g.dtype)
        return xp.where(mask, g / count, 0)


class Max(_Extreme):
    __slots__ = ()
    _fn = "max"


class Min(_Extreme):
    __slots__ = ()
    _fn = "min"
