"""A remote device's ``xp``: the NumPy functions tensorlib calls, returning ``RemoteArray``\\ s.

Each function checks its arguments as NumPy would (shapes, dtypes) so that errors show at
the call, computes the result's shape and dtype, and queues one record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._records import FLAG_OUT
from . import _array as _a
from . import _infer
from ._array import RemoteArray, code

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["RemoteNamespace"]


def _dtype(dtype: Any, default: Any = np.float64) -> np.dtype[Any]:
    return np.dtype(default if dtype is None else dtype)


def _shape(shape: Any) -> tuple[int, ...]:
    out = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError("negative dimensions are not allowed")
    return out


class RemoteNamespace:
    """NumPy's names for one remote device (``device.xp``)."""

    __name__ = "remote"
    bool_ = np.bool_
    int32, int64 = np.int32, np.int64
    float16, float32, float64 = np.float16, np.float32, np.float64

    def __init__(self, session: Session) -> None:
        self._s = session

    def __repr__(self) -> str:
        return f"<array module of {self._s.device}>"

    # ------------------------------------------------------------------ creation
    def full(self, shape: Any, fill_value: Any, dtype: Any = None) -> RemoteArray:
        if dtype is None:
            dtype = np.asarray(fill_value).dtype
        dt, sh = np.dtype(dtype), _shape(shape)
        fill = fill_value.item() if isinstance(fill_value, np.generic) else fill_value
        if type(fill) not in (bool, int, float):
            raise TypeError(f"full: fill_value must be a number, got {type(fill_value).__name__}")
        return self._s.issue_new(code("full"), (sh, fill, dt), sh, dt)

    def zeros(self, shape: Any, dtype: Any = None) -> RemoteArray:
        return self.full(shape, 0, _dtype(dtype))

    def ones(self, shape: Any, dtype: Any = None) -> RemoteArray:
        return self.full(shape, 1, _dtype(dtype))

    def empty(self, shape: Any, dtype: Any = None) -> RemoteArray:
        return self.full(shape, 0, _dtype(dtype))

    def zeros_like(self, a: RemoteArray, dtype: Any = None) -> RemoteArray:
        return self.full(a.shape, 0, a.dtype if dtype is None else dtype)

    def ones_like(self, a: RemoteArray, dtype: Any = None) -> RemoteArray:
        return self.full(a.shape, 1, a.dtype if dtype is None else dtype)

    def empty_like(self, a: RemoteArray, dtype: Any = None) -> RemoteArray:
        return self.zeros_like(a, dtype)

    def full_like(self, a: RemoteArray, fill_value: Any, dtype: Any = None) -> RemoteArray:
        return self.full(a.shape, fill_value, a.dtype if dtype is None else dtype)

    def arange(self, start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> RemoteArray:
        if stop is None:
            start, stop = 0, start
        if dtype is None:
            dtype = np.arange(start, start + step, step).dtype  # NumPy's choice, on one step
        dt = np.dtype(dtype)
        n = max(0, math.ceil((stop - start) / step))
        return self._s.issue_new(code("arange"), (start, stop, step, dt), (n,), dt)

    def asarray(self, a: Any, dtype: Any = None) -> RemoteArray:
        if type(a) is RemoteArray:
            self._s.operand_shape(a)  # same device
            return a if dtype is None else a.astype(dtype, copy=False)
        host = np.asarray(a, dtype=dtype)
        return self._s.upload(host)

    def array(self, a: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> RemoteArray:
        if type(a) is RemoteArray:
            out = self.asarray(a, dtype)
            return out.copy() if copy and out is a else out
        return self.asarray(a, dtype)

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> RemoteArray:
        out = self.asarray(a, dtype)
        return out if out._contig else out.copy()

    # ------------------------------------------------------------------ elementwise
    def add(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("add", a, b, out)

    def subtract(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("subtract", a, b, out)

    def multiply(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("multiply", a, b, out)

    def divide(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("true_divide", a, b, out)

    true_divide = divide

    def power(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("power", a, b, out)

    def maximum(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("maximum", a, b, out)

    def minimum(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("minimum", a, b, out)

    def logical_and(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("logical_and", a, b, out)

    def logical_or(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("logical_or", a, b, out)

    def equal(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _binary("equal", a, b, out)

    def exp(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("exp", a, out)

    def log(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("log", a, out)

    def sqrt(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("sqrt", a, out)

    def tanh(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("tanh", a, out)

    def abs(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("absolute", a, out)

    absolute = abs

    def sign(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("sign", a, out)

    def negative(self, a: Any, out: RemoteArray | None = None) -> Any:
        return _a.unary("negative", a, out)

    def isfinite(self, a: Any) -> Any:
        return _a.unary("isfinite", a)

    def isnan(self, a: Any) -> Any:
        return _a.unary("isnan", a)

    def isinf(self, a: Any) -> Any:
        return _a.unary("isinf", a)

    def logical_not(self, a: Any) -> Any:
        return _a.unary("logical_not", a)

    def square(self, a: Any) -> Any:
        return _a.unary("square", a)

    def matmul(self, a: Any, b: Any, out: RemoteArray | None = None) -> Any:
        return _a.matmul(a, b, out)

    def where(self, cond: Any, a: Any, b: Any) -> RemoteArray:
        sess = self._operands(cond, a, b)
        shape = _infer.broadcast(*(sess.operand_shape(x) or () for x in (cond, a, b)))
        key = ("where", _kind(a), _kind(b))
        dt = _infer.dtype_by_example(
            key, lambda c, x, y: np.where(c, x, y), np.bool_, key[1], key[2]
        )
        return sess.issue_new(code("where"), (cond, a, b), shape, dt)

    def clip(self, a: Any, lo: Any, hi: Any, out: RemoteArray | None = None) -> RemoteArray:
        sess = self._operands(a, lo, hi)
        shape = _infer.broadcast(*(sess.operand_shape(x) or () for x in (a, lo, hi)))
        key = ("clip", _kind(a), _kind(lo), _kind(hi))
        dt = _infer.dtype_by_example(key, lambda x, y, z: np.clip(x, y, z), *key[1:])
        if out is not None:
            sess.issue(code("clip"), FLAG_OUT, out._id, (a, lo, hi))
            return out
        return sess.issue_new(code("clip"), (a, lo, hi), shape, dt)

    # ------------------------------------------------------------------ movement
    def broadcast_to(self, a: RemoteArray, shape: Any) -> RemoteArray:
        sh = _shape(shape)
        if len(sh) < a.ndim or _infer.broadcast(a.shape, sh) != sh:
            raise ValueError(
                f"operands could not be broadcast together with remapped shapes "
                f"[original->remapped]: {a.shape} and requested shape {sh}"
            )
        return a._sess.issue_new(
            code("broadcast_to"),
            (a, sh),
            sh,
            a.dtype,
            view_of=a,
            contig=sh == a.shape and a._contig,
        )

    def expand_dims(self, a: RemoteArray, axis: Any) -> RemoteArray:
        axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
        ndim = a.ndim + len(axes)
        norm = _infer.norm_axes(axes, ndim) or ()
        it = iter(a.shape)
        shape = tuple(1 if i in norm else next(it) for i in range(ndim))
        return a._sess.issue_new(
            code("expand_dims"), (a, norm), shape, a.dtype, view_of=a, contig=a._contig
        )

    def concatenate(self, arrays: Sequence[Any], axis: int = 0) -> RemoteArray:
        return self._join("concatenate", arrays, axis)

    def stack(self, arrays: Sequence[Any], axis: int = 0) -> RemoteArray:
        return self._join("stack", arrays, axis)

    def _join(self, name: str, arrays: Sequence[Any], axis: int) -> RemoteArray:
        arrays = [self.asarray(x) for x in arrays]
        if not arrays:
            raise ValueError("need at least one array to concatenate")
        shapes = [x.shape for x in arrays]
        if name == "stack":
            if any(s != shapes[0] for s in shapes):
                raise ValueError("all input arrays must have the same shape")
            ax = (_infer.norm_axes(axis, len(shapes[0]) + 1) or (0,))[0]
            shape = shapes[0][:ax] + (len(arrays),) + shapes[0][ax:]
        else:
            ndim = len(shapes[0])
            if ndim == 0:
                raise ValueError("zero-dimensional arrays cannot be concatenated")
            ax = (_infer.norm_axes(axis, ndim) or (0,))[0]
            for s in shapes:
                if len(s) != ndim or s[:ax] + s[ax + 1 :] != shapes[0][:ax] + shapes[0][ax + 1 :]:
                    raise ValueError(
                        f"all the input array dimensions except for the concatenation axis must "
                        f"match exactly, got {shapes}"
                    )
            shape = shapes[0][:ax] + (sum(s[ax] for s in shapes),) + shapes[0][ax + 1 :]
        dt = np.result_type(*(x.dtype for x in arrays))
        return self._s.issue_new(code(name), (tuple(arrays), ax), shape, dt)

    def add_at(self, a: RemoteArray, index: Any, values: Any) -> None:
        """NumPy's ``np.add.at(a, index, values)``: unbuffered, repeated indices add up."""
        sess = self._operands(a, values)
        sess.issue(code("add_at"), FLAG_OUT, a._id, (sess.index_arg(index), values))

    def sum(
        self, a: RemoteArray, axis: Any = None, dtype: Any = None, keepdims: bool = False
    ) -> Any:
        return a.sum(axis=axis, dtype=dtype, keepdims=keepdims)

    def mean(
        self, a: RemoteArray, axis: Any = None, dtype: Any = None, keepdims: bool = False
    ) -> Any:
        return a.mean(axis=axis, dtype=dtype, keepdims=keepdims)

    def _operands(self, *xs: Any) -> Session:
        for x in xs:
            if self._s.operand_shape(x) is None:
                raise TypeError(f"a {type(x).__name__} cannot be an operand on {self._s.device}")
        return self._s


def _kind(x: Any) -> Any:
    t = type(x)
    if t is bool or t is int or t is float:
        return t
    return np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype


def _binary(name: str, a: Any, b: Any, out: RemoteArray | None) -> Any:
    if out is not None:
        return _a.inplace(name, a, b, out)
    out_ = _a.binary(name, a, b) if RemoteArray in (type(a), type(b)) else NotImplemented
    if out_ is NotImplemented:
        raise TypeError(
            f"{name}: operands must be remote arrays of one device, numbers or NumPy arrays, "
            f"got {type(a).__name__} and {type(b).__name__}"
        )
    return out_
