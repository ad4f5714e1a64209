"""The fake ``cupy.ndarray`` and ``cupy.array``.

An array keeps its data in a private NumPy array on one fake GPU; what runs on it as a kernel
goes through ._kernels. Views stay on their base's device.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ._device import Device, MemoryPointer, _current
from ._kernels import (
    _SCALARS,
    Host,
    _arg_reduction,
    _arithmetic,
    _binary,
    _bind_array_type,
    _bounds,
    _check_dtype,
    _check_peer,
    _fresh,
    _garbage,
    _Host,
    _host_index,
    _kernel_method,
    _launch,
    _ufunc_call,
    _unary,
    _unsupported,
    _with_ellipsis,
    _wrap_indices,
)
from ._stream import Stream, _note_sync

# cupy.f for np.f(fake_array) (``__array_function__``), filled in by ._functions.
_NUMPY_FUNCTIONS: dict[str, Callable[..., Any]] = {}


# ============================================================================ the array
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
    shape = _Host[tuple[int, ...]](tuple)
    strides = _Host[tuple[int, ...]](tuple)
    dtype = _Host[np.dtype[Any]]()
    ndim = _Host[int]()
    size = _Host[int]()
    itemsize = _Host[int]()
    nbytes = _Host[int]()

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
        if isinstance(stream, Stream) and not stream._is_null:
            stream._wait_for(stream._submitted)  # a device-to-host copy is ordered on its stream
        if blocking:
            _note_sync("ndarray.get")
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
        _note_sync("ndarray.item")
        return self._a.item()

    def tolist(self) -> Any:
        _note_sync("ndarray.tolist")
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
        impl = _NUMPY_FUNCTIONS.get(func.__name__) if func.__module__ == "numpy" else None
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
        return _fresh(self._a[_wrap_indices(host_index, self._a.shape)], device_id, (self._a,))

    def __setitem__(self, index: Any, value: Any) -> None:
        device_id = _current.device
        host_index, advanced, fakes = _host_index(index)
        if advanced:
            # A scatter kernel; CuPy copies a host value to the device first (cupy.array).
            for a in (self, *fakes):
                _check_peer(a, device_id)
            v = value if isinstance(value, _SCALARS) else array(value, dtype=self.dtype)
            self._a[_wrap_indices(host_index, self._a.shape)] = (
                v._a if isinstance(v, ndarray) else v
            )
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
    sum = _kernel_method("sum", "axis", "dtype", "out", "keepdims")
    mean = _kernel_method("mean", "axis", "dtype", "out", "keepdims")
    prod = _kernel_method("prod", "axis", "dtype", "out", "keepdims")
    var = _kernel_method("var", "axis", "dtype", "out", "ddof", "keepdims")
    std = _kernel_method("std", "axis", "dtype", "out", "ddof", "keepdims")
    max = _kernel_method("max", "axis", "out", "keepdims")
    min = _kernel_method("min", "axis", "out", "keepdims")
    any = _kernel_method("any", "axis", "out", "keepdims")
    all = _kernel_method("all", "axis", "out", "keepdims")
    argmax = _arg_reduction("argmax")
    argmin = _arg_reduction("argmin")
    cumsum = _kernel_method("cumsum", "axis", "dtype", "out")
    round = _kernel_method("round", "decimals", "out")
    conj = _kernel_method("conj")
    nonzero = _kernel_method("nonzero")

    def clip(self, min: Any = None, max: Any = None, out: Any = None) -> Any:
        if min is None and max is None:
            raise ValueError("array_clip: must set either max or min")
        lo, hi = _bounds(self.dtype)
        return _launch(
            np.clip, (self, lo if min is None else min, hi if max is None else max), {"out": out}
        )

    def dot(self, b: Any, out: Any = None) -> Any:
        return _launch(np.dot, (self, b), {"out": out})

    def argsort(self, axis: int = -1) -> Any:
        return self._method("argsort", axis=axis)

    def sort(self, axis: int = -1) -> None:
        _check_peer(self, _current.device)
        self._a.sort(axis=axis)

    # ------------------------------------------------------------------ operators
    __add__, __radd__, __iadd__ = _arithmetic(np.add)
    __sub__, __rsub__, __isub__ = _arithmetic(np.subtract)
    __mul__, __rmul__, __imul__ = _arithmetic(np.multiply)
    __truediv__, __rtruediv__, __itruediv__ = _arithmetic(np.true_divide)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _arithmetic(np.floor_divide)
    __mod__, __rmod__, __imod__ = _arithmetic(np.remainder)
    __pow__, __rpow__, __ipow__ = _arithmetic(np.power)
    __and__, __rand__, __iand__ = _arithmetic(np.bitwise_and)
    __or__, __ror__, __ior__ = _arithmetic(np.bitwise_or)
    __xor__, __rxor__, __ixor__ = _arithmetic(np.bitwise_xor)
    __matmul__, __rmatmul__ = _binary(np.matmul), _binary(np.matmul, reflected=True)
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


_bind_array_type(ndarray)


class _Capsule:
    """Stands in for a DLPack capsule: only this fake's ``from_dlpack`` can open it."""

    def __init__(self, array: ndarray) -> None:
        self.array = array


# ============================================================================ cupy.array
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
