"""The fake's kernels: how a call on fake arrays runs on the host, as a kernel on the current
device, and the factories that make ``ndarray``'s operators, methods and attributes from NumPy's.

A kernel takes fake arrays of the current device (``_check_peer``) and Python/NumPy scalars,
refuses NumPy arrays (0-d ones included: ``TypeError: Unsupported type``), and returns new fake
arrays (0-d ones too, never NumPy scalars), never a view of its input.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from ._device import _current, config

if TYPE_CHECKING:
    from ._array import ndarray
else:
    ndarray = None  # the array type: bound by ._array (arrays and kernels use each other)

Host = np.ndarray[Any, Any]
_SCALARS = (bool, int, float, complex, np.generic)
_NO_KWARGS: dict[str, Any] = {}
_T = TypeVar("_T")
# What an operator takes on (NumPy arrays only to raise the CuPy error); bound with ndarray.
_OPERAND_TYPES: tuple[type, ...] = ()


def _bind_array_type(cls: type[ndarray]) -> None:
    """Called by ._array once ``ndarray`` exists."""
    global ndarray, _OPERAND_TYPES
    ndarray = cls  # type: ignore[misc]  # the late binding the TYPE_CHECKING import stands for
    _OPERAND_TYPES = (cls, np.ndarray, *_SCALARS)


def _check_peer(array: ndarray, device_id: int) -> None:
    if array._dev != device_id and not config.peer_access:
        raise ValueError(
            f"The device where the array resides ({array._dev}) is different from the current "
            f"device ({device_id}). Peer access is unavailable between these devices."
        )


# ============================================================================ kernel plumbing
def _unsupported(x: Any) -> TypeError:
    return TypeError(f"Unsupported type {type(x)}")


def _operand(x: Any, device_id: int) -> Any:
    """A kernel argument: a fake array on the current device, or a Python/NumPy scalar."""
    if isinstance(x, ndarray):
        _check_peer(x, device_id)
        return x._a
    if isinstance(x, _SCALARS):
        return x
    raise _unsupported(x)  # NumPy arrays (0-d included), lists, ...


def _argument(x: Any, device_id: int) -> Any:
    """A method argument: fake arrays are unwrapped, NumPy arrays refused, the rest passed on."""
    if isinstance(x, ndarray):
        _check_peer(x, device_id)
        return x._a
    if isinstance(x, np.ndarray):
        raise _unsupported(x)
    return x


def _output(out: Any, device_id: int) -> Any:
    if isinstance(out, tuple):
        return tuple(_output(o, device_id) for o in out)
    if not isinstance(out, ndarray):
        raise TypeError(f"Output arguments must be cupy.ndarray, got {type(out)}")
    _check_peer(out, device_id)
    return out._a


def _fresh(r: Any, device_id: int, inputs: Sequence[Any] = ()) -> Any:
    """Wrap what NumPy computed as new arrays on the current device (0-d, never scalars)."""
    if isinstance(r, tuple):
        return tuple(_fresh(x, device_id, inputs) for x in r)
    if isinstance(r, np.generic):
        return ndarray._wrap(np.array(r), device_id)
    if isinstance(r, np.ndarray):
        if any(isinstance(h, np.ndarray) and np.may_share_memory(r, h) for h in inputs):
            r = r.copy()  # a kernel always writes a new array
        return ndarray._wrap(r, device_id)
    return r


def _launch(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], strict: bool = True
) -> Any:
    """Run ``fn`` on the host arrays as a kernel on the current device."""
    device_id = _current.device
    convert = _operand if strict else _argument
    host = [convert(a, device_id) for a in args]
    out = kwargs.get("out")
    if out is not None:
        kwargs = {**kwargs, "out": _output(out, device_id)}
    with np.errstate(all="ignore"):  # GPU kernels never warn about overflow or nan
        r = fn(*host, **kwargs)
    return out if out is not None else _fresh(r, device_id, host)


def _ufunc_call(ufunc: np.ufunc, method: str, inputs: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    device_id = _current.device
    host = [_operand(x, device_id) for x in inputs]
    out = kwargs.get("out")
    outs: tuple[Any, ...] = ()
    if out is not None:
        outs = out if isinstance(out, tuple) else (out,)
        kwargs = {**kwargs, "out": tuple(_output(o, device_id) for o in outs)}
    with np.errstate(all="ignore"):
        r = getattr(ufunc, method)(*host, **kwargs)
    if outs:
        return outs[0] if len(outs) == 1 else outs
    return _fresh(r, device_id, host)


def _require(x: Any) -> ndarray:
    if not isinstance(x, ndarray):
        raise TypeError(f"expected a cupy.ndarray, got {type(x)}")
    return x


def _host_index(index: Any) -> tuple[tuple[Any, ...], bool, list[ndarray]]:
    """The index with fake arrays unwrapped; whether it is advanced; the fake arrays in it."""
    parts = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    fakes: list[ndarray] = []
    advanced = False
    for p in parts:
        if isinstance(p, ndarray):
            fakes.append(p)
            out.append(p._a)
            advanced = True
        elif p is None or p is Ellipsis or isinstance(p, slice):
            out.append(p)
        elif isinstance(p, bool | np.bool_):
            out.append(p)
            advanced = True
        elif isinstance(p, int | np.integer):
            out.append(p)
        elif isinstance(p, np.ndarray | list | tuple):
            if not config.allow_host_index:
                raise TypeError(
                    f"fake cupy: index array on the host ({type(p).__name__}); CuPy would copy "
                    "it to the GPU synchronously on every use: move it there once"
                )
            out.append(np.asarray(p))
            advanced = True
        else:
            out.append(p)  # NumPy decides (and raises IndexError for floats and the like)
    return tuple(out), advanced, fakes


def _wrap_indices(index: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    """CuPy does not bounds-check integer index arrays: it wraps them around each axis (an
    index i of an axis of n is i mod n), so an out-of-range label picks a wrong row silently.
    Python ints and slices are basic indexing and keep NumPy's rules."""
    if not any(isinstance(p, np.ndarray) and p.dtype.kind in "iu" for p in index):
        return index
    n_axes = sum(
        p.ndim if isinstance(p, np.ndarray) and p.dtype == bool else 1
        for p in index
        if p is not None and p is not Ellipsis
    )
    out: list[Any] = []
    axis = 0
    for p in index:
        if p is Ellipsis:
            axis += len(shape) - n_axes
        elif p is None:
            pass
        elif isinstance(p, np.ndarray) and p.dtype == bool:
            axis += p.ndim
        else:
            if isinstance(p, np.ndarray) and p.dtype.kind in "iu" and axis < len(shape):
                size = shape[axis]
                p = np.mod(p, size) if size else p  # an empty axis: NumPy's IndexError
            axis += 1
        out.append(p)
    return tuple(out)


def _with_ellipsis(index: tuple[Any, ...]) -> tuple[Any, ...]:
    # NumPy returns a scalar for a[0] on a 1-d array; a[0, ...] is the 0-d view CuPy returns.
    return index if any(p is Ellipsis for p in index) else (*index, Ellipsis)


def _garbage(shape: Any, dtype: Any, order: str = "C") -> Host:
    a = np.empty(shape, dtype=dtype, order="F" if order.upper() == "F" else "C")
    if a.dtype.kind in "fc":
        a.fill(np.nan)
    elif a.dtype.kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    elif a.dtype.kind == "b":
        a.fill(True)
    return a


def _check_dtype(a: Host) -> None:
    if a.dtype.kind not in "biufc":
        raise ValueError(f"Unsupported dtype {a.dtype}")


def _bounds(dtype: np.dtype[Any]) -> tuple[Any, Any]:
    if dtype.kind == "f":
        return -np.inf, np.inf
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min, info.max
    return 0, 1


# ============================================================================ the array's members
def _binary(ufunc: np.ufunc, reflected: bool = False) -> Callable[[ndarray, Any], Any]:
    def op(self: ndarray, other: Any) -> Any:
        if not isinstance(other, _OPERAND_TYPES):
            return NotImplemented  # e.g. a Tensor: let its reflected operator run
        args = (other, self) if reflected else (self, other)
        return _ufunc_call(ufunc, "__call__", args, _NO_KWARGS)

    return op


def _inplace(ufunc: np.ufunc) -> Callable[[ndarray, Any], Any]:
    def op(self: ndarray, other: Any) -> Any:
        if not isinstance(other, _OPERAND_TYPES):
            return NotImplemented
        _ufunc_call(ufunc, "__call__", (self, other), {"out": (self,)})
        return self

    return op


def _arithmetic(ufunc: np.ufunc) -> tuple[Callable[[ndarray, Any], Any], ...]:
    """``__op__``, ``__rop__`` and ``__iop__`` of a binary ufunc."""
    return _binary(ufunc), _binary(ufunc, reflected=True), _inplace(ufunc)


def _unary(ufunc: np.ufunc) -> Callable[[ndarray], Any]:
    def op(self: ndarray) -> Any:
        return _ufunc_call(ufunc, "__call__", (self,), _NO_KWARGS)

    return op


_DEFAULTS: dict[str, Any] = {
    "axis": None,
    "dtype": None,
    "out": None,
    "ddof": 0,
    "keepdims": False,
    "decimals": 0,
    "order": "C",
}


def _kernel_method(name: str, *params: str) -> Callable[..., Any]:
    """``ndarray.<name>(params...)``: NumPy's method of that name run as a kernel, with these
    parameters only (positional or keyword, in this order, CuPy's defaults), passed by name."""
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [
            inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_DEFAULTS[p])
            for p in params
        ]
    )

    def method(self: ndarray, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return self._method(name, **{p: bound.arguments[p] for p in params})

    method.__name__, method.__qualname__ = name, f"ndarray.{name}"
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


def _arg_reduction(name: str) -> Callable[..., Any]:
    """``argmax``/``argmin``, whose ``dtype`` casts the indices NumPy returns."""

    def method(
        self: ndarray, axis: Any = None, out: Any = None, dtype: Any = None, keepdims: bool = False
    ) -> Any:
        r = self._method(name, axis=axis, out=out, keepdims=keepdims)
        return r if dtype is None else r.astype(dtype, copy=False)

    method.__name__, method.__qualname__ = name, f"ndarray.{name}"
    return method


class _Host(Generic[_T]):
    """A read-only attribute of the host array, through ``convert`` (e.g. to a tuple)."""

    def __init__(self, convert: Callable[[Any], _T] | None = None) -> None:
        self._convert = convert

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: ndarray | None, owner: type | None = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]  # on the class: the descriptor
        value = getattr(obj._a, self._name)
        return value if self._convert is None else self._convert(value)
