"""``RemoteArray``: a handle to an array that lives in a server's session, used like NumPy's.

Every operation on a handle becomes one record for the server (``Session.issue``)
and returns a new handle at once: its shape and dtype are inferred here (``_infer``) and its
id is chosen here, so nothing waits. Only reads (``get``, ``item``, ``bool``, ``repr``) wait
for the server. A handle that is garbage-collected sends a drop record, freeing the array.

Here: what a handle is (attributes, reads, conversions) and its arithmetic (operators,
ufuncs, reductions, matmul: ``binary``, ``inplace``, ``unary``, ``reduce``, ``matmul``, which
the device's ``xp`` calls too). Its movement, indexing and copies, and which of them are
views, are ``_movement``'s (bound here as methods).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._records import FLAG_OUT
from .._wire import OP_CODES, Handle
from . import _infer
from . import _movement as _mv

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["RemoteArray"]

_NUMBER = (bool, int, float)


def code(name: str) -> int:
    return OP_CODES[name]


_MATMUL = OP_CODES["matmul"]
_memo_get, _memo_put = _infer.memo_get, _infer.memo_put


class _Flags:
    __slots__ = ("c_contiguous",)

    def __init__(self, c: bool) -> None:
        self.c_contiguous = c

    @property
    def f_contiguous(self) -> bool:  # pragma: no cover - not used by tensorlib
        return False


class RemoteArray(Handle):
    """An array on a remote device (create them through the device's ``xp`` or tensorlib).

    Attributes:
        shape, dtype, ndim: as NumPy's.
        base: the array this one is a view of (None when it owns its data).
    """

    __slots__ = ("_contig", "_sess", "base", "dtype", "ndim", "shape")

    __array_priority__ = 1000
    __array_ufunc__ = None  # NumPy defers to our reflected operators
    __hash__ = None  # type: ignore[assignment]  # like ndarray: mutable, so unhashable

    _sess: Session
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    ndim: int
    base: RemoteArray | None
    _contig: bool

    def __del__(self) -> None:
        try:
            self._sess.drops.append(self._id)
        except Exception:  # interpreter shutdown: nothing to free any more
            pass

    # ------------------------------------------------------------------ attributes
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def flags(self) -> _Flags:
        return _Flags(self._contig)

    @property
    def T(self) -> RemoteArray:
        return self.transpose()

    @property
    def device(self) -> Any:
        """The tensorlib device this array lives on."""
        return self._sess.device

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    # ------------------------------------------------------------------ reads (they wait)
    def get(self) -> np.ndarray[Any, Any]:
        """Copy to a NumPy array (a round trip; raises errors of earlier failed ops)."""
        return self._sess.read(self)

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self) -> Any:
        return self.get().tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        a = self.get()
        return a if dtype is None else a.astype(dtype)

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(
                "The truth value of an array with more than one element is ambiguous. "
                "Use a.any() or a.all()"
            )
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        if self.dtype.kind not in "iu" or self.ndim:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.item())

    def __repr__(self) -> str:
        return f"RemoteArray({self.get()!r}, device='{self._sess.device}')"

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise TypeError("a remote array cannot be exported through DLPack; copy it with .get()")

    # ------------------------------------------------------------------ operators
    def __add__(self, o: Any) -> Any:
        return binary("add", self, o)

    def __radd__(self, o: Any) -> Any:
        return binary("add", o, self)

    def __iadd__(self, o: Any) -> Any:
        return inplace("add", self, o)

    def __sub__(self, o: Any) -> Any:
        return binary("subtract", self, o)

    def __rsub__(self, o: Any) -> Any:
        return binary("subtract", o, self)

    def __isub__(self, o: Any) -> Any:
        return inplace("subtract", self, o)

    def __mul__(self, o: Any) -> Any:
        return binary("multiply", self, o)

    def __rmul__(self, o: Any) -> Any:
        return binary("multiply", o, self)

    def __imul__(self, o: Any) -> Any:
        return inplace("multiply", self, o)

    def __truediv__(self, o: Any) -> Any:
        return binary("true_divide", self, o)

    def __rtruediv__(self, o: Any) -> Any:
        return binary("true_divide", o, self)

    def __itruediv__(self, o: Any) -> Any:
        return inplace("true_divide", self, o)

    def __floordiv__(self, o: Any) -> Any:
        return binary("floor_divide", self, o)

    def __rfloordiv__(self, o: Any) -> Any:
        return binary("floor_divide", o, self)

    def __mod__(self, o: Any) -> Any:
        return binary("remainder", self, o)

    def __rmod__(self, o: Any) -> Any:
        return binary("remainder", o, self)

    def __pow__(self, o: Any) -> Any:
        return binary("power", self, o)

    def __rpow__(self, o: Any) -> Any:
        return binary("power", o, self)

    def __ipow__(self, o: Any) -> Any:
        return inplace("power", self, o)

    def __matmul__(self, o: Any) -> Any:
        return matmul(self, o)

    def __rmatmul__(self, o: Any) -> Any:
        return matmul(o, self)

    def __and__(self, o: Any) -> Any:
        return binary("bitwise_and", self, o)

    def __rand__(self, o: Any) -> Any:
        return binary("bitwise_and", o, self)

    def __iand__(self, o: Any) -> Any:
        return inplace("bitwise_and", self, o)

    def __or__(self, o: Any) -> Any:
        return binary("bitwise_or", self, o)

    def __ror__(self, o: Any) -> Any:
        return binary("bitwise_or", o, self)

    def __ior__(self, o: Any) -> Any:
        return inplace("bitwise_or", self, o)

    def __xor__(self, o: Any) -> Any:
        return binary("bitwise_xor", self, o)

    def __rxor__(self, o: Any) -> Any:
        return binary("bitwise_xor", o, self)

    def __eq__(self, o: Any) -> Any:
        return binary("equal", self, o)

    def __ne__(self, o: Any) -> Any:
        return binary("not_equal", self, o)

    def __lt__(self, o: Any) -> Any:
        return binary("less", self, o)

    def __le__(self, o: Any) -> Any:
        return binary("less_equal", self, o)

    def __gt__(self, o: Any) -> Any:
        return binary("greater", self, o)

    def __ge__(self, o: Any) -> Any:
        return binary("greater_equal", self, o)

    def __neg__(self) -> RemoteArray:
        return unary("negative", self)

    def __pos__(self) -> RemoteArray:
        return unary("positive", self)

    def __abs__(self) -> RemoteArray:
        return unary("absolute", self)

    def __invert__(self) -> RemoteArray:
        return unary("invert", self)

    # ------------------------------------------------------------------ methods
    def sum(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return reduce("sum", self, axis, keepdims, dtype, out)

    def mean(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return reduce("mean", self, axis, keepdims, dtype, out)

    def prod(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return reduce("prod", self, axis, keepdims, dtype, out)

    def max(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("max", self, axis, keepdims, None, out)

    def min(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("min", self, axis, keepdims, None, out)

    def any(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("any", self, axis, keepdims, None, out)

    def all(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("all", self, axis, keepdims, None, out)

    def argmax(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("argmax", self, axis, keepdims, None, out)

    def argmin(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return reduce("argmin", self, axis, keepdims, None, out)

    # ------------------------------------------------------------------ movement (_movement)
    reshape = _mv.reshape
    ravel = _mv.ravel
    flatten = _mv.flatten
    transpose = _mv.transpose
    swapaxes = _mv.swapaxes
    squeeze = _mv.squeeze
    astype = _mv.astype
    copy = _mv.copy
    fill = _mv.fill
    __getitem__ = _mv.getitem
    __setitem__ = _mv.setitem


# ---------------------------------------------------------------------------- op helpers
def _session_of(*xs: Any) -> Session:
    sess = None
    for x in xs:
        if type(x) is RemoteArray:
            if sess is None:
                sess = x._sess
            elif x._sess is not sess:
                raise ValueError(
                    f"arrays on different devices in one op: {sess.device} and {x._sess.device}"
                )
    if sess is None:  # pragma: no cover - callers pass at least one handle
        raise TypeError("no remote array among the operands")
    return sess


def binary(name: str, a: Any, b: Any) -> Any:
    """``ufunc(a, b)`` for the binary ufunc ``name``; NotImplemented for foreign operands."""
    ta, tb = type(a), type(b)
    if ta is RemoteArray and tb is RemoteArray:  # the common case, checked cheaply
        sess = a._sess
        if b._sess is not sess:
            _session_of(a, b)
        shape = a.shape if a.shape == b.shape else _infer.broadcast(a.shape, b.shape)
        key = (name, a.dtype, b.dtype)
    elif ta is RemoteArray and tb in _NUMBER:  # array and Python number: weak (NEP 50)
        sess, shape, key = a._sess, a.shape, (name, a.dtype, tb)
    elif tb is RemoteArray and ta in _NUMBER:
        sess, shape, key = b._sess, b.shape, (name, ta, b.dtype)
    else:
        if not _operand(a) or not _operand(b):
            return NotImplemented
        sess = _session_of(a, b)
        shape = _shape_of(a, b)
        key = (name, _infer.weak(a), _infer.weak(b))
    dt = _infer.ufunc_cache.get(key)
    if dt is None:
        dt = _infer.ufunc_dtype(getattr(np, name), a, b)
        _infer.ufunc_cache[key] = dt
    return sess.issue_new(OP_CODES[name], (a, b), shape, dt)


def inplace(name: str, a: RemoteArray, b: Any, out: RemoteArray | None = None) -> Any:
    """``ufunc(a, b, out=out or a)``: written into an existing array, which is returned."""
    if not _operand(b):
        return NotImplemented
    target = a if out is None else out
    sess = _session_of(a, b, target)
    shape = _shape_of(a, b)
    if shape != target.shape and _infer.broadcast(shape, target.shape) != target.shape:
        raise ValueError(
            f"non-broadcastable output operand with shape {target.shape} doesn't match the "
            f"broadcast shape {shape}"
        )
    key = (name, _infer.weak(a), _infer.weak(b), target.dtype)
    if key not in _castable:
        dt = _infer.ufunc_dtype(getattr(np, name), a, b)
        if not np.can_cast(dt, target.dtype, "same_kind"):
            raise TypeError(
                f"Cannot cast ufunc '{name}' output from {dt} to {target.dtype} with casting "
                "rule 'same_kind'"
            )
        _castable.add(key)
    sess.issue(OP_CODES[name], FLAG_OUT, target._id, (a, b))
    return target


_castable: set[tuple[Any, ...]] = set()


def unary(name: str, a: Any, out: RemoteArray | None = None) -> Any:
    """``ufunc(a)`` for the unary ufunc ``name`` (into ``out`` when given)."""
    sess = _session_of(a)
    dt = _infer.ufunc_dtype(getattr(np, name), a)
    if out is not None:
        sess.issue(code(name), FLAG_OUT, out._id, (a,))
        return out
    return sess.issue_new(code(name), (a,), a.shape, dt)


def _operand(x: Any) -> bool:
    return type(x) is RemoteArray or type(x) in _NUMBER or isinstance(x, np.ndarray | np.generic)


def _shape_of(a: Any, b: Any) -> tuple[int, ...]:
    sa = () if type(a) in _NUMBER else a.shape
    sb = () if type(b) in _NUMBER else b.shape
    return sa if sa == sb else _infer.broadcast(sa, sb)


_REDUCE_FN = {
    "sum": lambda x, dt: x.sum(dtype=dt),
    "mean": lambda x, dt: x.mean(dtype=dt),
    "prod": lambda x, dt: x.prod(dtype=dt),
    "max": lambda x, dt: x.max(),
    "min": lambda x, dt: x.min(),
    "any": lambda x, dt: x.any(),
    "all": lambda x, dt: x.all(),
    "argmax": lambda x, dt: x.argmax(),
    "argmin": lambda x, dt: x.argmin(),
}


def reduce(name: str, a: RemoteArray, axis: Any, keepdims: bool, dtype: Any, out: Any) -> Any:
    """The reduction ``name`` of ``a`` over ``axis`` (into ``out`` when given)."""
    key = (name, a.shape, a.dtype, axis, type(axis), keepdims, dtype)
    hit = _memo_get(key)
    if hit is None:
        hit = _reduce_infer(name, a, axis, keepdims, dtype)
        _memo_put(key, hit)
    tail, shape, dt = hit
    if out is not None:
        if type(out) is not RemoteArray or out.shape != shape:
            raise ValueError(f"{name}: out must be a remote array of shape {shape}")
        a._sess.issue(OP_CODES[name], FLAG_OUT, out._id, (a, *tail))
        return out
    return a._sess.issue_new(OP_CODES[name], (a, *tail), shape, dt)


def _reduce_infer(
    name: str, a: RemoteArray, axis: Any, keepdims: bool, dtype: Any
) -> tuple[tuple[Any, ...], tuple[int, ...], np.dtype[Any]]:
    """(the record's values after ``a``, the result's shape, its dtype)."""
    if name in ("argmax", "argmin") and isinstance(axis, tuple | list):
        raise TypeError(f"{name}: axis must be an int or None")
    dt_arg = None if dtype is None else np.dtype(dtype)
    shape = _infer.reduce_shape(a.shape, axis, keepdims)
    if name in ("argmax", "argmin") and axis is None and keepdims:
        shape = (1,) * a.ndim
    key = (name, a.dtype, dt_arg)
    dt = _infer.dtype_by_example(key, lambda x: _REDUCE_FN[name](x, dt_arg), a.dtype)
    axis_arg = (
        None
        if axis is None
        else (int(axis) if isinstance(axis, int | np.integer) else tuple(int(i) for i in axis))
    )
    return (axis_arg, bool(keepdims), dt_arg), shape, dt


def matmul(a: Any, b: Any, out: RemoteArray | None = None) -> Any:
    """``a @ b`` with NumPy's rules (into ``out`` when given)."""
    if type(a) is RemoteArray and type(b) is RemoteArray and out is None:
        key = ("matmul", a.shape, b.shape, a.dtype, b.dtype)
        hit = _memo_get(key)
        if hit is not None and a._sess is b._sess:
            return a._sess.issue_new(_MATMUL, (a, b), *hit)
        res = _matmul(a, b, out)
        _memo_put(key, (res.shape, res.dtype))
        return res
    return _matmul(a, b, out)


def _matmul(a: Any, b: Any, out: RemoteArray | None = None) -> Any:
    if not _operand(a) or not _operand(b) or type(a) in _NUMBER or type(b) in _NUMBER:
        return NotImplemented
    sess = _session_of(a, b)
    shape = _infer.matmul_shape(_shape(a), _shape(b))
    dt = _infer.ufunc_dtype(np.matmul, a, b)
    if out is not None:
        if out.shape != shape:
            raise ValueError(f"matmul: out has shape {out.shape}, the product {shape}")
        sess.issue(code("matmul"), FLAG_OUT, out._id, (a, b))
        return out
    return sess.issue_new(code("matmul"), (a, b), shape, dt)


def _shape(x: Any) -> tuple[int, ...]:
    return x.shape if type(x) is RemoteArray else tuple(np.shape(x))
