"""Module-level versions of Tensor operations (``tensorlib.exp(x)``, ``tensorlib.where(...)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _ops_elementwise as _ew
from . import _ops_linalg as _la
from . import _ops_movement as _mv
from ._device import device_of
from ._dtype import result_type
from ._tensor import Tensor

__all__ = [
    "abs",
    "broadcast_to",
    "clip",
    "concatenate",
    "exp",
    "log",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "permute",
    "reshape",
    "sqrt",
    "stack",
    "sum",
    "tanh",
    "transpose",
    "where",
]


def _t(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    return Tensor(x)


def exp(x: Tensor) -> Tensor:
    """Elementwise e**x."""
    return _t(x).exp()


def log(x: Tensor) -> Tensor:
    """Elementwise natural log."""
    return _t(x).log()


def sqrt(x: Tensor) -> Tensor:
    """Elementwise square root."""
    return _t(x).sqrt()


def tanh(x: Tensor) -> Tensor:
    """Elementwise tanh."""
    return _t(x).tanh()


def abs(x: Tensor) -> Tensor:
    """Elementwise absolute value."""
    return _t(x).abs()


def clip(x: Tensor, min: float | None = None, max: float | None = None) -> Tensor:
    """Clamp to [min, max]."""
    return _t(x).clip(min, max)


def maximum(a: Any, b: Any) -> Tensor:
    """Elementwise maximum with broadcasting (ties share the gradient)."""
    return _ew.Maximum.apply(a, b)


def minimum(a: Any, b: Any) -> Tensor:
    """Elementwise minimum with broadcasting (ties share the gradient)."""
    return _ew.Minimum.apply(a, b)


def where(condition: Any, a: Any, b: Any) -> Tensor:
    """Pick ``a`` where ``condition`` is true, else ``b`` (broadcasting all three)."""
    cond = condition._data if isinstance(condition, Tensor) else condition
    if isinstance(cond, np.generic | bool):  # a bool scalar: a 0-d mask
        cond = np.asarray(cond)
    # Why: the condition is passed as a raw array, so Function.apply never checked its device:
    # a condition on another device than a and b failed inside CuPy ("Unsupported type"), and
    # a NumPy mask with GPU tensors did too. Check the one, move the other (as index arrays).
    dev = next((t._device for t in (a, b) if isinstance(t, Tensor)), None)
    if dev is not None:
        if isinstance(condition, Tensor) and condition._device is not dev:
            raise RuntimeError(
                f"where: condition is on {condition._device} but the tensors are on {dev}"
            )
        if dev.type != "cpu" and isinstance(cond, np.ndarray):
            with dev:
                cond = dev.xp.asarray(cond)
    if not hasattr(a, "dtype") and not hasattr(b, "dtype"):
        # Two Python numbers: give them torch's dtype (where(c, 1.0, 0.0) is float32), as
        # 0-d arrays, since promotion has no array to cast.
        rt = result_type(a, b)
        if rt is not None:
            xp = _ew.xp_of(cond)
            # No tensor operand to run apply on its device: the condition's GPU is made
            # current here, for these arrays and the op, whichever GPU is current.
            with device_of(cond):
                a, b = xp.asarray(a, dtype=rt), xp.asarray(b, dtype=rt)
                return _ew.Where.apply(cond, a, b)
    return _ew.Where.apply(cond, a, b)


def sum(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis``."""
    return _t(x).sum(axis, keepdims)


def mean(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis``."""
    return _t(x).mean(axis, keepdims)


def max(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis``."""
    return _t(x).max(axis, keepdims)


def min(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Minimum over ``axis``."""
    return _t(x).min(axis, keepdims)


def matmul(a: Any, b: Any) -> Tensor:
    """Matrix product with NumPy's rules (batched, 1-d operands promoted)."""
    return _la.Matmul.apply(a, b)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Reshape ``x``."""
    return _t(x).reshape(tuple(shape))


def transpose(x: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    """Permute axes (reverse them when ``axes`` is None)."""
    return _t(x).transpose(*(() if axes is None else (tuple(axes),)))


def permute(x: Tensor, axes: Sequence[int]) -> Tensor:
    """Permute axes."""
    return _t(x).transpose(tuple(axes))


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Broadcast ``x`` to ``shape``."""
    return _t(x).broadcast_to(shape)


def concatenate(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    return _mv.Concatenate.apply(*tensors, axis=axis)


def stack(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along a new axis."""
    return _mv.Stack.apply(*tensors, axis=axis)
