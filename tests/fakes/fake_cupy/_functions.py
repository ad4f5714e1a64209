"""The fake ``cupy``, ``cupy.random`` and ``cupyx`` functions, and the table of what ``cupy``
holds (:data:`API`, :data:`CONSTANTS`): anything not listed there does not exist."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from ._array import _NUMPY_FUNCTIONS, _Capsule, array, ndarray
from ._device import _current
from ._kernels import (
    _SCALARS,
    Host,
    _check_peer,
    _host_index,
    _launch,
    _require,
    _ufunc_call,
    _wrap_indices,
)

# The modules make_modules built last (get_array_module returns their cupy).
_MODULES: dict[str, types.ModuleType] = {}


# ============================================================================ cupy


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    """``cupy.asarray``: like :func:`array` with ``copy=False``."""
    return array(a, dtype, copy=False, order="K" if order is None else order, blocking=blocking)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    x = _require(a)
    dt = x.dtype if dtype is None else np.dtype(dtype)
    if dt == x.dtype and x._a.flags.c_contiguous and x.ndim:
        return x
    return _launch(lambda h: np.array(h, dtype=dt, order="C", ndmin=1), (x,), {})


def asnumpy(a: Any, stream: Any = None, order: Any = "C", out: Any = None) -> Host:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _filled(ndarray(shape, dtype, order=order), 0)


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _filled(ndarray(shape, dtype, order=order), 1)


def _filled(a: ndarray, value: Any) -> ndarray:
    a.fill(value)
    return a


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    if dtype is None:
        dtype = fill_value.dtype if isinstance(fill_value, ndarray) else np.array(fill_value).dtype
    a = ndarray(shape, dtype, order=order)
    if isinstance(fill_value, ndarray):
        a[...] = fill_value
    else:
        a.fill(fill_value)
    return a


def empty_like(a: Any, dtype: Any = None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a: Any, dtype: Any = None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def ones_like(a: Any, dtype: Any = None) -> ndarray:
    return ones(a.shape, a.dtype if dtype is None else dtype)


def full_like(a: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    return full(a.shape, fill_value, a.dtype if dtype is None else dtype)


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> ndarray:
    return ndarray._wrap(np.arange(start, stop, step, dtype=dtype), _current.device)


def where(condition: Any, x: Any = None, y: Any = None) -> Any:
    if x is None and y is None:
        return _require(condition).nonzero()
    if x is None or y is None:
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    return _launch(np.where, (condition, x, y), {})


def clip(a: Any, a_min: Any, a_max: Any, out: Any = None) -> Any:
    return _require(a).clip(a_min, a_max, out=out)


def broadcast_to(array: Any, shape: Any) -> ndarray:
    x = _require(array)
    return x._view(np.broadcast_to(x._a, shape))


def expand_dims(a: Any, axis: Any) -> ndarray:
    x = _require(a)
    return x._view(np.expand_dims(x._a, axis))


def squeeze(a: Any, axis: Any = None) -> ndarray:
    return _require(a).squeeze(axis)


def reshape(a: Any, newshape: Any, order: str = "C") -> ndarray:
    return _require(a).reshape(newshape, order=order)


def transpose(a: Any, axes: Any = None) -> ndarray:
    return _require(a).transpose(axes)


def swapaxes(a: Any, axis1: int, axis2: int) -> ndarray:
    return _require(a).swapaxes(axis1, axis2)


def _only_cupy(tup: Any) -> list[ndarray]:
    arrays = list(tup)
    if not arrays:
        raise ValueError("Cannot concatenate from empty tuple")
    for x in arrays:
        if not isinstance(x, ndarray):
            raise TypeError(f"Only cupy arrays can be concatenated, got {type(x)}")
    return arrays


def concatenate(
    tup: Any, axis: Any = 0, out: Any = None, *, dtype: Any = None, casting: str = "same_kind"
) -> Any:
    return _join(np.concatenate, tup, axis, out, dtype, casting)


def stack(
    tup: Any, axis: int = 0, out: Any = None, *, dtype: Any = None, casting: str = "same_kind"
) -> Any:
    return _join(np.stack, tup, axis, out, dtype, casting)


def _join(join: Any, tup: Any, axis: Any, out: Any, dtype: Any, casting: str) -> Any:
    def run(*hs: Any, **kw: Any) -> Any:
        return join(hs, axis=axis, dtype=dtype, casting=casting, **kw)

    return _launch(run, _only_cupy(tup), {} if out is None else {"out": out})


def _reduction(name: str) -> Callable[..., Any]:
    def fn(a: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(_require(a), name)(*args, **kwargs)

    fn.__name__ = name
    return fn


def dot(a: Any, b: Any, out: Any = None) -> Any:
    return _require(a).dot(b, out=out)


def get_array_module(*args: Any) -> types.ModuleType:
    if any(isinstance(a, ndarray) for a in args) and _MODULES:
        return _MODULES["cupy"]
    return np


def from_dlpack(x: Any, *, device: Any = None, copy: Any = None) -> ndarray:
    """Zero-copy import from a (fake) CuPy producer: an array, or anything forwarding one."""
    dev_type, dev_id = x.__dlpack_device__()
    if int(dev_type) != 2:
        raise BufferError(
            f"fake cupy.from_dlpack: device type {int(dev_type)} is not kDLCUDA (2); CuPy "
            "does not import host memory"
        )
    capsule = x.__dlpack__()
    if not isinstance(capsule, _Capsule):
        raise TypeError(f"fake cupy.from_dlpack: not a fake-CuPy producer ({type(x)})")
    return ndarray._wrap(capsule.array._a.view(), int(dev_id))


def _ufunc(ufunc: np.ufunc) -> Callable[..., Any]:
    def fn(*args: Any, **kwargs: Any) -> Any:
        return _ufunc_call(ufunc, "__call__", args, kwargs)

    fn.__name__ = ufunc.__name__
    return fn


# ============================================================================ cupy.random, cupyx
class Generator:
    """``cupy.random.Generator``: draws on the current device (float32/float64 only)."""

    def __init__(self, seed: Any = None) -> None:
        self._rng = np.random.default_rng(seed)

    def _floating(self, draw: Callable[..., Any], size: Any, dtype: Any) -> ndarray:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"Unsupported dtype {dt.name}: only float32 and float64 are allowed")
        return ndarray._wrap(np.asarray(draw(size, dtype=dt)), _current.device)

    def random(self, size: Any = None, dtype: Any = np.float64, out: Any = None) -> ndarray:
        if out is not None:
            raise NotImplementedError("fake Generator.random(out=...)")
        return self._floating(self._rng.random, size, dtype)

    def standard_normal(
        self, size: Any = None, dtype: Any = np.float64, out: Any = None
    ) -> ndarray:
        if out is not None:
            raise NotImplementedError("fake Generator.standard_normal(out=...)")
        return self._floating(self._rng.standard_normal, size, dtype)

    def uniform(
        self, low: float = 0.0, high: float = 1.0, size: Any = None, dtype: Any = np.float64
    ) -> ndarray:
        def draw(size: Any, dtype: Any) -> Any:
            return self._rng.uniform(low, high, size).astype(dtype)

        return self._floating(draw, size, dtype)

    def integers(
        self,
        low: int,
        high: int | None = None,
        size: Any = None,
        dtype: Any = np.int64,
        endpoint: bool = False,
    ) -> ndarray:
        host = self._rng.integers(low, high, size, dtype=dtype, endpoint=endpoint)
        return ndarray._wrap(np.asarray(host), _current.device)


def default_rng(seed: Any = None) -> Generator:
    return Generator(seed)


_SCATTER_ADD_DTYPES = frozenset(
    np.dtype(t) for t in (np.int32, np.float16, np.float32, np.float64, np.uint32, np.uint64)
)


def scatter_add(a: Any, slices: Any, value: Any) -> None:
    """``cupyx.scatter_add``: ``a[slices] += value`` where repeated indices add up."""
    x = _require(a)
    device_id = _current.device
    host_index, _, fakes = _host_index(slices)
    for f in (x, *fakes):
        _check_peer(f, device_id)
    int_arrays = [p for p in host_index if isinstance(p, np.ndarray) and p.dtype.kind in "iu"]
    if int_arrays and x.dtype not in _SCATTER_ADD_DTYPES:
        raise TypeError(
            "scatter_add only supports int32, float16, float32, float64, uint32, uint64, as "
            "data type"
        )
    if isinstance(value, ndarray):
        _check_peer(value, device_id)
        v: Any = value._a.astype(x.dtype, copy=False)
    elif isinstance(value, _SCALARS):
        v = value
    else:
        v = array(value, dtype=x.dtype)._a  # CuPy copies a host value to the device
    with np.errstate(all="ignore"):
        np.add.at(x._a, _wrap_indices(host_index, x._a.shape), v)  # wrapped, as CuPy's scatter ops


# ============================================================================ what cupy holds
# fmt: off
_DTYPES = (
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
    "float32", "float64", "complex64", "complex128",
)
_UFUNCS = (
    "add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "power", "negative",
    "exp", "expm1", "log", "log1p", "sqrt", "square", "tanh", "abs", "absolute", "sign",
    "maximum", "minimum", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "logical_and", "logical_or", "logical_not", "isnan", "isinf", "isfinite", "floor", "ceil",
    "matmul",
)
_REDUCTIONS = ("sum", "mean", "prod", "max", "min", "argmax", "argmin", "any", "all")
_FUNCTIONS = (
    ndarray, array, asarray, ascontiguousarray, asnumpy, empty, zeros, ones, full, empty_like,
    zeros_like, ones_like, full_like, arange, where, clip, broadcast_to, expand_dims, squeeze,
    reshape, transpose, swapaxes, concatenate, stack, dot, get_array_module, from_dlpack,
)
# fmt: on

API: dict[str, Any] = {
    **{f.__name__: f for f in _FUNCTIONS},
    "amax": _reduction("max"),
    "amin": _reduction("min"),
    **{name: _reduction(name) for name in _REDUCTIONS},
    **{name: _ufunc(getattr(np, name)) for name in _UFUNCS},
}
CONSTANTS: dict[str, Any] = {
    "__version__": "0.0-fake",
    "dtype": np.dtype,
    "newaxis": None,
    "inf": np.inf,
    "nan": np.nan,
    "pi": np.pi,
    "e": np.e,
    **{name: getattr(np, name) for name in _DTYPES},
}
_NUMPY_FUNCTIONS.update(API)
