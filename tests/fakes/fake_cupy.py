"""A fake CuPy over host memory, so that GPU code paths run (and fail loudly) without a GPU.

:func:`install` puts ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.random`` and
``cupyx`` into ``sys.modules`` (``tests/conftest.py`` does it when ``TENSORLIB_FAKE_CUPY=1``).
An array keeps its data in a private NumPy array, but it is *not* a NumPy array, and it is as
strict as real CuPy wherever code that is wrong on a GPU would still pass on NumPy:

* ``isinstance(x, numpy.ndarray)`` is False (as for a real CuPy array; an ndarray subclass would
  take NumPy branches such as ``a.get() if not isinstance(a, np.ndarray) else a``), and
  ``numpy.asarray(x)`` or any implicit conversion raises ``TypeError`` ("Implicit conversion to
  a NumPy array is not allowed"): code must call ``x.get()``.
* Kernels (operators, ufuncs, reductions, ``where``, ``concatenate``...) refuse NumPy arrays,
  0-d ones included (``TypeError: Unsupported type <class 'numpy.ndarray'>``); Python and NumPy
  scalars are fine. Their results are fake arrays, 0-d ones too (never NumPy scalars).
* New arrays live on the *current* device (``with cupy.cuda.Device(1): ...``), views on their
  base's; ``x.device.id`` tells which. A kernel given an array from another device raises
  ``ValueError``, as CuPy does where GPUs have no peer access (with peer access CuPy computes
  on the current device, silently leaving the result on another GPU than its input).
* NumPy or list *index arrays* raise ``TypeError``: CuPy accepts them but copies them to the
  device synchronously on every use (``config.allow_host_index = True`` accepts them).
* ``a[basic_index] = numpy_array`` raises ``ValueError`` ("non-scalar numpy.ndarray cannot be
  used for fill"), ``cupyx.scatter_add`` accepts only CuPy's dtypes, ``Generator.random`` only
  float32/float64, copying a strided array between devices raises ``NotImplementedError``, and
  ``empty`` is filled with NaN (or the largest integer) the way device memory holds garbage.
* Only the API built in :func:`make_modules` exists; anything else raises ``AttributeError``.

Streams: kernels run on the host at once, so the null stream is the host; other streams are
ordered queues with a thread each, for the asynchronous work a communication library enqueues
(``memcpyAsync``, ``ndarray.set(stream=)``, the fake NCCL), with events that complete when the
work before them has run (see :class:`Stream`).

Deliberate differences: integer index arrays are bounds-checked (CuPy wraps them around),
NumPy's type promotion rules apply, kernels are synchronous, and broadcast views are read-only.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import itertools
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "CUDARuntimeError",
    "Device",
    "Event",
    "Generator",
    "Stream",
    "alloc_pinned_memory",
    "config",
    "get_current_stream",
    "install",
    "make_modules",
    "ndarray",
    "reset",
]

Host = np.ndarray[Any, Any]
_SCALARS = (bool, int, float, complex, np.generic)
_NO_KWARGS: dict[str, Any] = {}


# ============================================================================ devices
class _Config:
    """Module-wide knobs of the fake (set them with :func:`reset` or :func:`install`)."""

    def __init__(self) -> None:
        self.device_count = 2
        self.peer_access = False
        # CuPy accepts NumPy/list index arrays, at the cost of a synchronous host-to-device copy
        # on every use; the fake refuses them unless this is set, so they are not left behind.
        self.allow_host_index = False


config = _Config()


class _Current(threading.local):
    # The current CUDA device is per host thread, as in the CUDA runtime.
    def __init__(self) -> None:
        self.device = 0


_current = _Current()


def reset(device_count: int = 2, peer_access: bool = False, allow_host_index: bool = False) -> None:
    """Set the fake's knobs (see :class:`_Config`) and make GPU 0 current on this thread."""
    config.device_count = device_count
    config.peer_access = peer_access
    config.allow_host_index = allow_host_index
    _current.device = 0


class CUDARuntimeError(RuntimeError):
    """What the CUDA runtime raises (here only for an invalid device ordinal)."""


def _check_ordinal(device_id: int) -> None:
    if not 0 <= device_id < config.device_count:
        raise CUDARuntimeError(
            f"cudaErrorInvalidDevice: invalid device ordinal {device_id} "
            f"({config.device_count} fake GPU(s))"
        )


class Device:
    """``cupy.cuda.Device``: ``with Device(i):`` makes GPU ``i`` current; ``use()`` for good."""

    def __init__(self, device: Any = None) -> None:
        if device is None:
            self.id = _current.device
        elif isinstance(device, Device):
            self.id = device.id
        else:
            self.id = int(device)
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        _check_ordinal(self.id)
        self._previous.append(_current.device)
        _current.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _current.device = self._previous.pop()

    def use(self) -> None:
        """Make this device current (until changed again)."""
        _check_ordinal(self.id)
        _current.device = self.id

    def synchronize(self) -> None:
        """Wait for the device (nothing is asynchronous here)."""
        _check_ordinal(self.id)

    @property
    def compute_capability(self) -> str:
        return "90"

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("fake-cuda-device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class MemoryPointer:
    """``cupy.cuda.MemoryPointer`` (``ptr`` is a host address here)."""

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)


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


# ============================================================================ the array
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


def _unary(ufunc: np.ufunc) -> Callable[[ndarray], Any]:
    def op(self: ndarray) -> Any:
        return _ufunc_call(ufunc, "__call__", (self,), _NO_KWARGS)

    return op


class ndarray:
    """``cupy.ndarray``: memory on one (fake) GPU, held in a private NumPy array."""

    __module__ = "cupy"  # tensorlib (like much CuPy-aware code) tells arrays apart by module
    __slots__ = ("__weakref__", "_a", "_base", "_dev")
    __array_priority__ = 100.0

    _a: Host
    _dev: int
    _base: ndarray | None

    def __init__(
        self,
        shape: Any,
        dtype: Any = float,
        memptr: Any = None,
        strides: Any = None,
        order: str = "C",
    ) -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError("fake cupy.ndarray: memptr= and strides= are not supported")
        self._a = _garbage(shape, dtype, order)
        self._dev = _current.device
        self._base = None

    @classmethod
    def _wrap(cls, a: Host, device_id: int, base: ndarray | None = None) -> ndarray:
        obj = object.__new__(cls)
        obj._a, obj._dev, obj._base = a, device_id, base
        return obj

    def _view(self, a: Host) -> ndarray:
        return ndarray._wrap(a, self._dev, self._base if self._base is not None else self)

    def _derived(self, a: Host) -> ndarray:
        """What NumPy returned from a reshape-like call: a view of self, or a copy (a kernel)."""
        if np.may_share_memory(a, self._a):
            return self._view(a)
        device_id = _current.device
        _check_peer(self, device_id)
        return ndarray._wrap(a, device_id)

    def _method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return _launch(getattr(np.ndarray, name), (self, *args), kwargs, strict=False)

    # ------------------------------------------------------------------ attributes
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._a.shape)

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._a.dtype

    @property
    def itemsize(self) -> int:
        return self._a.itemsize

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self._a.strides)

    @property
    def flags(self) -> types.SimpleNamespace:
        f = self._a.flags
        return types.SimpleNamespace(
            c_contiguous=f.c_contiguous, f_contiguous=f.f_contiguous, owndata=self._base is None
        )

    @property
    def base(self) -> ndarray | None:
        return self._base

    @property
    def device(self) -> Device:
        return Device(self._dev)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(int(self._a.__array_interface__["data"][0]), self._dev)

    @property
    def T(self) -> ndarray:
        return self._view(self._a.T)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": [("", self.dtype.str)],
            "data": (self.data.ptr, False),
            "strides": None if self._a.flags.c_contiguous else self.strides,
            "version": 3,
        }

    # ------------------------------------------------------------------ to the host
    def __array__(self, dtype: Any = None, copy: Any = None) -> Host:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def get(
        self, stream: Any = None, order: str = "C", out: Host | None = None, blocking: bool = True
    ) -> Host:
        """Copy to a new NumPy array (or into ``out``), after ``stream``'s queued work."""
        if isinstance(stream, Stream):
            stream.synchronize()  # a device-to-host copy is ordered on its stream
        host = np.array(self._a, order=order, copy=True)  # type: ignore[call-overload]
        if out is None:
            return host
        if not isinstance(out, np.ndarray):
            raise TypeError(
                f"Only numpy.ndarray can be obtained from cupy.ndarray, got {type(out)}"
            )
        if out.shape != host.shape or out.dtype != host.dtype:
            raise ValueError(f"Shape or dtype mismatch: {out.shape} {out.dtype} vs {host.shape}")
        out[...] = host
        return out

    def set(self, arr: Host, stream: Any = None) -> None:
        """Copy a NumPy array of the same shape and dtype into this array."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if isinstance(stream, Stream) and not stream._is_null:
            # Pageable host memory is staged at once; the device write is ordered on the stream.
            snapshot = arr.copy()
            target = self._a

            def write() -> None:
                target[...] = snapshot

            stream._enqueue(write)
            return
        self._a[...] = arr

    def item(self) -> Any:
        return self._a.item()

    def tolist(self) -> Any:
        return self._a.tolist()

    def tobytes(self, order: str = "C") -> bytes:
        return self._a.tobytes(order)  # type: ignore[arg-type]

    def __float__(self) -> float:
        return float(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def __complex__(self) -> complex:
        return complex(self.get())

    def __bool__(self) -> bool:
        return bool(self.get())

    def __len__(self) -> int:
        if self._a.ndim == 0:
            raise TypeError("len() of unsized object")
        return int(self._a.shape[0])

    def __iter__(self) -> Iterator[ndarray]:
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return np.array_repr(self._a)

    def __str__(self) -> str:
        return str(self._a)

    # ------------------------------------------------------------------ NumPy protocols
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method not in ("__call__", "reduce"):
            return NotImplemented  # e.g. np.add.at: NumPy then raises TypeError
        return _ufunc_call(ufunc, method, inputs, kwargs)

    def __array_function__(
        self, func: Any, types_: Any, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        # As CuPy: np.f(cupy_array) runs cupy.f when CuPy has it (here: when the fake has it).
        impl = _API.get(func.__name__) if func.__module__ == "numpy" else None
        if impl is None:
            return NotImplemented
        return impl(*args, **kwargs)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> _Capsule:
        return _Capsule(self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._dev)  # (kDLCUDA, device id)

    # ------------------------------------------------------------------ shape (views)
    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        return self._derived(self._a.reshape(*shape, order=order))  # type: ignore[call-overload]

    def transpose(self, *axes: Any) -> ndarray:
        return self._view(self._a.transpose(*axes))

    def swapaxes(self, axis1: int, axis2: int) -> ndarray:
        return self._view(self._a.swapaxes(axis1, axis2))

    def squeeze(self, axis: Any = None) -> ndarray:
        return self._view(self._a.squeeze(axis))

    def ravel(self, order: str = "C") -> ndarray:
        return self._derived(self._a.ravel(order))  # type: ignore[arg-type]

    def view(self, dtype: Any = None) -> ndarray:
        return self._view(self._a.view() if dtype is None else self._a.view(dtype))

    def diagonal(self, offset: int = 0, axis1: int = 0, axis2: int = 1) -> ndarray:
        return self._view(self._a.diagonal(offset, axis1, axis2))

    # ------------------------------------------------------------------ copies and casts
    def flatten(self, order: str = "C") -> ndarray:
        return self._method("flatten", order)

    def astype(
        self,
        dtype: Any,
        order: str = "K",
        casting: Any = None,
        subok: Any = None,
        copy: bool = True,
    ) -> ndarray:
        dt = np.dtype(dtype)
        if not copy and dt == self.dtype:
            return self
        return _launch(lambda a: a.astype(dt, order=order), (self,), {})

    def copy(self, order: str = "C") -> ndarray:
        """A copy on the current device (copies between devices are memcpy, no kernel)."""
        device_id = _current.device
        flags = self._a.flags
        if (
            self._dev != device_id
            and self.size
            and order.upper() == "K"
            and not (flags.c_contiguous or flags.f_contiguous)
        ):
            raise NotImplementedError("CuPy cannot copy non-contiguous array between devices.")
        return ndarray._wrap(self._a.copy(order=order), device_id)  # type: ignore[arg-type]

    def fill(self, value: Any) -> None:
        """Set every element to a scalar (a 0-d array counts as one)."""
        device_id = _current.device
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            _check_peer(self, device_id)
            _check_peer(value, device_id)
            self._a.fill(value._a.item())
            return
        if isinstance(value, np.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.astype(self.dtype).item()
        elif not isinstance(value, _SCALARS):
            raise _unsupported(value)
        if not (value == 0 and self._a.flags.c_contiguous):  # zeroing is a memset, no kernel
            _check_peer(self, device_id)
        self._a.fill(value)

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, index: Any) -> ndarray:
        host_index, advanced, fakes = _host_index(index)
        if not advanced:
            return self._view(self._a[_with_ellipsis(host_index)])
        device_id = _current.device
        for a in (self, *fakes):
            _check_peer(a, device_id)
        return _fresh(self._a[host_index], device_id, (self._a,))

    def __setitem__(self, index: Any, value: Any) -> None:
        device_id = _current.device
        host_index, advanced, fakes = _host_index(index)
        if advanced:
            # A scatter kernel; CuPy copies a host value to the device first (cupy.array).
            for a in (self, *fakes):
                _check_peer(a, device_id)
            v = value if isinstance(value, _SCALARS) else array(value, dtype=self.dtype)
            self._a[host_index] = v._a if isinstance(v, ndarray) else v
            return
        target = self._a[_with_ellipsis(host_index)]
        if not isinstance(value, ndarray):
            self._view(target).fill(value)  # CuPy: a basic index with a non-CuPy value is fill()
            return
        memcpy = (
            value._a.shape == target.shape
            and value._a.strides == target.strides
            and value.dtype == target.dtype
            and target.flags.c_contiguous
        )
        if not memcpy:
            _check_peer(self, device_id)
            _check_peer(value, device_id)
        target[...] = value._a

    # ------------------------------------------------------------------ reductions and math
    def sum(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return self._method("sum", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def mean(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return self._method("mean", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def prod(
        self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False
    ) -> Any:
        return self._method("prod", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def var(
        self,
        axis: Any = None,
        dtype: Any = None,
        out: Any = None,
        ddof: int = 0,
        keepdims: bool = False,
    ) -> Any:
        return self._method("var", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)

    def std(
        self,
        axis: Any = None,
        dtype: Any = None,
        out: Any = None,
        ddof: int = 0,
        keepdims: bool = False,
    ) -> Any:
        return self._method("std", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)

    def max(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return self._method("max", axis=axis, out=out, keepdims=keepdims)

    def min(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return self._method("min", axis=axis, out=out, keepdims=keepdims)

    def argmax(
        self, axis: Any = None, out: Any = None, dtype: Any = None, keepdims: bool = False
    ) -> Any:
        r = self._method("argmax", axis=axis, out=out, keepdims=keepdims)
        return r if dtype is None else r.astype(dtype, copy=False)

    def argmin(
        self, axis: Any = None, out: Any = None, dtype: Any = None, keepdims: bool = False
    ) -> Any:
        r = self._method("argmin", axis=axis, out=out, keepdims=keepdims)
        return r if dtype is None else r.astype(dtype, copy=False)

    def any(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return self._method("any", axis=axis, out=out, keepdims=keepdims)

    def all(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> Any:
        return self._method("all", axis=axis, out=out, keepdims=keepdims)

    def cumsum(self, axis: Any = None, dtype: Any = None, out: Any = None) -> Any:
        return self._method("cumsum", axis=axis, dtype=dtype, out=out)

    def clip(self, min: Any = None, max: Any = None, out: Any = None) -> Any:
        if min is None and max is None:
            raise ValueError("array_clip: must set either max or min")
        lo, hi = _bounds(self.dtype)
        return _launch(
            np.clip, (self, lo if min is None else min, hi if max is None else max), {"out": out}
        )

    def round(self, decimals: int = 0, out: Any = None) -> Any:
        return self._method("round", decimals=decimals, out=out)

    def dot(self, b: Any, out: Any = None) -> Any:
        return _launch(np.dot, (self, b), {"out": out})

    def conj(self) -> Any:
        return self._method("conj")

    def nonzero(self) -> tuple[ndarray, ...]:
        return self._method("nonzero")

    def argsort(self, axis: int = -1) -> Any:
        return self._method("argsort", axis=axis)

    def sort(self, axis: int = -1) -> None:
        _check_peer(self, _current.device)
        self._a.sort(axis=axis)

    # ------------------------------------------------------------------ operators
    __add__ = _binary(np.add)
    __radd__ = _binary(np.add, reflected=True)
    __iadd__ = _inplace(np.add)
    __sub__ = _binary(np.subtract)
    __rsub__ = _binary(np.subtract, reflected=True)
    __isub__ = _inplace(np.subtract)
    __mul__ = _binary(np.multiply)
    __rmul__ = _binary(np.multiply, reflected=True)
    __imul__ = _inplace(np.multiply)
    __truediv__ = _binary(np.true_divide)
    __rtruediv__ = _binary(np.true_divide, reflected=True)
    __itruediv__ = _inplace(np.true_divide)
    __floordiv__ = _binary(np.floor_divide)
    __rfloordiv__ = _binary(np.floor_divide, reflected=True)
    __ifloordiv__ = _inplace(np.floor_divide)
    __mod__ = _binary(np.remainder)
    __rmod__ = _binary(np.remainder, reflected=True)
    __imod__ = _inplace(np.remainder)
    __pow__ = _binary(np.power)
    __rpow__ = _binary(np.power, reflected=True)
    __ipow__ = _inplace(np.power)
    __matmul__ = _binary(np.matmul)
    __rmatmul__ = _binary(np.matmul, reflected=True)
    __and__ = _binary(np.bitwise_and)
    __rand__ = _binary(np.bitwise_and, reflected=True)
    __iand__ = _inplace(np.bitwise_and)
    __or__ = _binary(np.bitwise_or)
    __ror__ = _binary(np.bitwise_or, reflected=True)
    __ior__ = _inplace(np.bitwise_or)
    __xor__ = _binary(np.bitwise_xor)
    __rxor__ = _binary(np.bitwise_xor, reflected=True)
    __ixor__ = _inplace(np.bitwise_xor)
    __lt__ = _binary(np.less)
    __le__ = _binary(np.less_equal)
    __gt__ = _binary(np.greater)
    __ge__ = _binary(np.greater_equal)
    __eq__ = _binary(np.equal)
    __ne__ = _binary(np.not_equal)
    __hash__ = None  # type: ignore[assignment]
    __neg__ = _unary(np.negative)
    __pos__ = _unary(np.positive)
    __abs__ = _unary(np.absolute)
    __invert__ = _unary(np.invert)


_OPERAND_TYPES = (ndarray, np.ndarray, *_SCALARS)  # NumPy arrays only to raise the CuPy error


class _Capsule:
    """Stands in for a DLPack capsule: only this fake's ``from_dlpack`` can open it."""

    def __init__(self, array: ndarray) -> None:
        self.array = array


# ============================================================================ module functions
def array(
    obj: Any,
    dtype: Any = None,
    copy: bool = True,
    order: str = "K",
    subok: bool = False,
    ndmin: int = 0,
    blocking: bool = False,
) -> ndarray:
    """``cupy.array``: host data is copied to the current device; CuPy arrays are copied to it
    (``copy=False`` keeps an array that needs no cast where it is, on any device)."""
    if subok:
        raise NotImplementedError("subok")
    device_id = _current.device
    if isinstance(obj, ndarray):
        dt = obj.dtype if dtype is None else np.dtype(dtype)
        if obj._dev == device_id:
            a = obj.astype(dt, order=order, copy=bool(copy))
        else:
            a = obj.copy(order=order).astype(dt, copy=False)
        if ndmin > a.ndim:
            a = a.reshape((1,) * (ndmin - a.ndim) + a.shape)
        return a
    leaves = _leaves(obj) if isinstance(obj, list | tuple) else []
    if leaves and all(isinstance(x, ndarray) for x in leaves):
        # A (nested) sequence of CuPy arrays is stacked on the device.
        shapes = {x.shape for x in leaves}
        if len(shapes) == 1:
            stacked = _launch(lambda *hs: np.stack(hs), leaves, {})
            out = stacked.reshape(_nested_shape(obj) + next(iter(shapes)))
            return out if dtype is None else out.astype(dtype, copy=False)
    host = np.array(obj, dtype=dtype, copy=True, ndmin=ndmin)  # raises for CuPy leaves
    _check_dtype(host)
    return ndarray._wrap(host, device_id)


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, list | tuple):
        return [leaf for x in obj for leaf in _leaves(x)]
    return [obj]


def _nested_shape(obj: Any) -> tuple[int, ...]:
    if isinstance(obj, list | tuple):
        return (len(obj), *(_nested_shape(obj[0]) if obj else ()))
    return ()


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
    a = ndarray(shape, dtype, order=order)
    a.fill(0)
    return a


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    a = ndarray(shape, dtype, order=order)
    a.fill(1)
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
    def run(*hs: Any, **kw: Any) -> Any:
        return np.concatenate(hs, axis=axis, dtype=dtype, casting=casting, **kw)  # type: ignore[call-overload]

    return _launch(run, _only_cupy(tup), {} if out is None else {"out": out})


def stack(
    tup: Any, axis: int = 0, out: Any = None, *, dtype: Any = None, casting: str = "same_kind"
) -> Any:
    def run(*hs: Any, **kw: Any) -> Any:
        return np.stack(hs, axis=axis, dtype=dtype, casting=casting, **kw)  # type: ignore[call-overload]

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


# ============================================================================ random, cupyx
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
        np.add.at(x._a, host_index, v)


# ============================================================================ streams and events
class _CurrentStream(threading.local):
    def __init__(self) -> None:
        self.stack: list[Stream] = []


_current_stream = _CurrentStream()
_stream_ptrs = itertools.count(0x57000)
_event_ptrs = itertools.count(0xE7000)
_IDLE_EXIT_S = 0.05  # a stream's worker thread ends after this long without work


class Stream:
    """``cupy.cuda.Stream``. Fake kernels run on the host at once, so the *null* stream is the
    host itself: an event recorded there is complete at once, and waiting on an event there
    blocks the host until it completes. Every other stream is a real queue, run in order by a
    worker thread of its own: :func:`memcpyAsync`, ``ndarray.set(stream=)`` and the fake NCCL
    (tests/fakes/fake_nccl.py) put work on it, and an event recorded there completes when the
    work queued before it has finished. ``ptr`` identifies the stream (``cudaStream_t``).
    """

    null: Stream
    _by_ptr: ClassVar[weakref.WeakValueDictionary[int, Stream]] = weakref.WeakValueDictionary()

    def __init__(
        self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority: Any = 0
    ) -> None:
        self._is_null = bool(null)
        self.ptr = 0 if null else next(_stream_ptrs)
        self.non_blocking = non_blocking
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], object]] = deque()
        self._submitted = 0
        self._finished = 0
        self._worker: threading.Thread | None = None
        self.errors: list[BaseException] = []  # what queued work raised (a bug in a fake)
        if not null:
            Stream._by_ptr[self.ptr] = self

    # ------------------------------------------------------------------ queue
    def _enqueue(self, fn: Callable[[], object]) -> int:
        """Queue ``fn``; return its ticket (done once ``_finished`` reaches it)."""
        if self._is_null:
            fn()
            return 0
        with self._cond:
            self._queue.append(fn)
            self._submitted += 1
            ticket = self._submitted
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"fake-cuda-stream-{self.ptr:#x}", daemon=True
                )
                self._worker.start()
            else:
                self._cond.notify_all()
        return ticket

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait(_IDLE_EXIT_S)
                    if not self._queue:
                        self._worker = None
                        return
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException as exc:  # pragma: no cover - a bug in fake work: keep it
                self.errors.append(exc)
            with self._cond:
                self._finished += 1
                self._cond.notify_all()

    def _reached(self, ticket: int) -> bool:
        return self._finished >= ticket

    def _wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._finished >= ticket, timeout)

    # ------------------------------------------------------------------ CuPy's API
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (as recorded now)."""
        source, ticket = event._stream, event._ticket
        if source is None or source is self:
            return
        if self._is_null:
            source._wait_for(ticket)  # the null stream is the host
            return
        self._enqueue(lambda: source._wait_for(ticket))

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when None) on this stream."""
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        """Block until everything queued so far has run."""
        if not self._is_null:
            self._wait_for(self._submitted)

    @property
    def done(self) -> bool:
        """Whether everything queued so far has run."""
        return self._is_null or self._finished >= self._submitted

    def use(self) -> Stream:
        """Make this the current stream of this thread."""
        _current_stream.stack[:] = [self]
        return self

    def __enter__(self) -> Stream:
        _current_stream.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current_stream.stack.pop()

    def __repr__(self) -> str:
        return f"<fake cupy.cuda.Stream {self.ptr:#x}{' (null)' if self._is_null else ''}>"


Stream.null = Stream(null=True)


def get_current_stream(device_id: int = -1) -> Stream:
    """This thread's current stream (the null stream unless one was made current)."""
    return _current_stream.stack[-1] if _current_stream.stack else Stream.null


def _stream_for(handle: Any) -> Stream:
    """The stream of a ``cudaStream_t`` (int) or Stream; 0 is the null stream."""
    if isinstance(handle, Stream):
        return handle
    ptr = int(handle or 0)
    if ptr == 0:
        return Stream.null
    stream = Stream._by_ptr.get(ptr)
    if stream is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream {ptr:#x}")
    return stream


class Event:
    """``cupy.cuda.Event``: complete once the work queued on its stream before ``record`` ran."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        self.ptr = next(_event_ptrs)
        self._stream: Stream | None = None
        self._ticket = 0
        self._when: float | None = None  # when it was seen complete (for get_elapsed_time)

    def record(self, stream: Stream | None = None) -> None:
        """Capture ``stream``'s queue as it is now (the current stream when None)."""
        s = stream if stream is not None else get_current_stream()
        if s._is_null:
            self._stream, self._ticket, self._when = None, 0, time.perf_counter()
        else:
            self._stream, self._ticket, self._when = s, s._submitted, None

    @property
    def done(self) -> bool:
        """Whether the work before the last ``record`` has run."""
        reached = self._stream is None or self._stream._reached(self._ticket)
        if reached and self._when is None:
            self._when = time.perf_counter()
        return reached

    def synchronize(self) -> None:
        """Block the host until :attr:`done`."""
        if self._stream is not None:
            self._stream._wait_for(self._ticket)
        if self._when is None:
            self._when = time.perf_counter()


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two events (here: when the host saw each complete)."""
    start_event.synchronize()
    end_event.synchronize()
    return ((end_event._when or 0.0) - (start_event._when or 0.0)) * 1e3


class PinnedMemoryPointer(bytearray):
    """``cupy.cuda.alloc_pinned_memory``'s result: host memory with a buffer and ``ptr``."""

    ptr: int


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    """Page-locked host memory (here: a bytearray that never moves)."""
    mem = PinnedMemoryPointer(int(size))
    mem.ptr = ctypes.addressof((ctypes.c_char * max(int(size), 1)).from_buffer(mem)) if size else 0
    return mem


_MEMCPY_KINDS = {
    0: "HostToHost",
    1: "HostToDevice",
    2: "DeviceToHost",
    3: "DeviceToDevice",
    4: "Default",
}


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: Any) -> None:
    """``cudaMemcpyAsync``: the copy runs in ``stream``'s order (host addresses here)."""
    if int(kind) not in _MEMCPY_KINDS:
        raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: {kind}")
    n = int(size)
    if n == 0:
        return
    if not dst or not src:
        raise CUDARuntimeError("cudaErrorInvalidValue: null pointer in memcpyAsync")
    d, s_ = int(dst), int(src)
    _stream_for(stream)._enqueue(lambda: ctypes.memmove(d, s_, n))


# ============================================================================ runtime
def _get_device_count() -> int:
    return config.device_count


def _get_device() -> int:
    return _current.device


def _set_device(device_id: int) -> None:
    Device(device_id).use()


def _runtime_version() -> int:
    return 12080


def _device_properties(device_id: int) -> dict[str, Any]:
    _check_ordinal(device_id)
    return {
        "name": b"Fake GPU (host memory)",
        "totalGlobalMem": 8 * 2**30,
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 1,
        "pciBusID": device_id,
    }


def _can_access_peer(device_id: int, peer_device_id: int) -> int:
    return int(config.peer_access)


def _is_available() -> bool:
    return config.device_count > 0


# ============================================================================ modules
_DTYPES = [
    "bool_",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
_UFUNCS = [
    "add",
    "subtract",
    "multiply",
    "divide",
    "true_divide",
    "floor_divide",
    "power",
    "negative",
    "exp",
    "expm1",
    "log",
    "log1p",
    "sqrt",
    "square",
    "tanh",
    "abs",
    "absolute",
    "sign",
    "maximum",
    "minimum",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_and",
    "logical_or",
    "logical_not",
    "isnan",
    "isinf",
    "isfinite",
    "floor",
    "ceil",
    "matmul",
]
_REDUCTIONS = ["sum", "mean", "prod", "max", "min", "argmax", "argmin", "any", "all"]

_API: dict[str, Any] = {
    "ndarray": ndarray,
    "array": array,
    "asarray": asarray,
    "ascontiguousarray": ascontiguousarray,
    "asnumpy": asnumpy,
    "empty": empty,
    "zeros": zeros,
    "ones": ones,
    "full": full,
    "empty_like": empty_like,
    "zeros_like": zeros_like,
    "ones_like": ones_like,
    "full_like": full_like,
    "arange": arange,
    "where": where,
    "clip": clip,
    "broadcast_to": broadcast_to,
    "expand_dims": expand_dims,
    "squeeze": squeeze,
    "reshape": reshape,
    "transpose": transpose,
    "swapaxes": swapaxes,
    "concatenate": concatenate,
    "stack": stack,
    "dot": dot,
    "get_array_module": get_array_module,
    "from_dlpack": from_dlpack,
    "amax": _reduction("max"),
    "amin": _reduction("min"),
    **{name: _reduction(name) for name in _REDUCTIONS},
    **{name: _ufunc(getattr(np, name)) for name in _UFUNCS},
}
_CONSTANTS: dict[str, Any] = {
    "__version__": "0.0-fake",
    "dtype": np.dtype,
    "newaxis": None,
    "inf": np.inf,
    "nan": np.nan,
    "pi": np.pi,
    "e": np.e,
    **{name: getattr(np, name) for name in _DTYPES},
}

_MODULES: dict[str, types.ModuleType] = {}


def _module(name: str, attrs: dict[str, Any], package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, f"Fake {name} (tests/fakes/fake_cupy.py): host memory, no GPU.")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def make_modules() -> dict[str, types.ModuleType]:
    """Fresh ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.random``, ``cupyx`` modules."""
    runtime = _module(
        "cupy.cuda.runtime",
        {
            "CUDARuntimeError": CUDARuntimeError,
            "getDeviceCount": _get_device_count,
            "getDevice": _get_device,
            "setDevice": _set_device,
            "runtimeGetVersion": _runtime_version,
            "driverGetVersion": _runtime_version,
            "getDeviceProperties": _device_properties,
            "deviceCanAccessPeer": _can_access_peer,
            "is_hip": False,
            "memcpyAsync": _memcpy_async,
            "memcpyHostToHost": 0,
            "memcpyHostToDevice": 1,
            "memcpyDeviceToHost": 2,
            "memcpyDeviceToDevice": 3,
            "memcpyDefault": 4,
        },
    )
    cuda = _module(
        "cupy.cuda",
        {
            "Device": Device,
            "MemoryPointer": MemoryPointer,
            "runtime": runtime,
            "is_available": _is_available,
            "get_device_id": _get_device,
            "Stream": Stream,
            "Event": Event,
            "get_current_stream": get_current_stream,
            "get_elapsed_time": get_elapsed_time,
            "alloc_pinned_memory": alloc_pinned_memory,
            "PinnedMemoryPointer": PinnedMemoryPointer,
        },
        package=True,
    )
    random = _module("cupy.random", {"Generator": Generator, "default_rng": default_rng})
    cupy = _module("cupy", {**_CONSTANTS, **_API, "cuda": cuda, "random": random}, package=True)
    cupyx = _module("cupyx", {"scatter_add": scatter_add}, package=True)
    modules = {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.runtime": runtime,
        "cupy.random": random,
        "cupyx": cupyx,
    }
    _MODULES.clear()
    _MODULES.update(modules)
    return modules


def install(
    target: MutableMapping[str, Any] | None = None,
    *,
    device_count: int = 2,
    peer_access: bool = False,
    allow_host_index: bool = False,
) -> dict[str, types.ModuleType]:
    """Put the fake modules into ``target`` (``sys.modules`` by default) and reset the fake.

    Returns the modules, e.g. to undo with ``monkeypatch.setitem`` instead: pass a dict and
    install each entry yourself.
    """
    reset(device_count=device_count, peer_access=peer_access, allow_host_index=allow_host_index)
    modules = make_modules()
    (sys.modules if target is None else target).update(modules)
    return modules
