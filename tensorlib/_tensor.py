"""The :class:`Tensor`: one NumPy or CuPy array plus what autodiff needs.

Its differentiable operations (one line each, onto one ``Function``) are in its base class,
:class:`~tensorlib._tensor_ops.TensorOps`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import _autograd, _backward
from ._device import CPU, Device, device_of, is_device_spec
from ._device_guard import DeviceGuard, on_device
from ._dtype import SUPPORTED, is_floating, normalize_dtype
from ._tensor_ops import Scalar, TensorOps

__all__ = ["Tensor"]


def _check_array_dtype(array: Any) -> None:
    if array.dtype not in SUPPORTED:
        raise TypeError(
            f"unsupported dtype {array.dtype}; tensorlib supports float16, float32, float64, "
            f"int32, int64, bool (convert with .astype() first)"
        )


def _value_on(value: Any, device: Device) -> Any:
    """``value`` ready to be written into an array on ``device``: Tensors are moved there, and
    on a GPU so are host arrays and lists.

    Why: CuPy assigns only scalars and CuPy arrays through a basic index (``a[0] = np_array``
    raises "non-scalar numpy.ndarray cannot be used for fill"), so ``t[0] = np_array`` and
    ``t.copy_(np_array)`` worked on the CPU but failed on a GPU.
    """
    if isinstance(value, Tensor):
        return value.detach().to(device)._data
    if device.type != "cpu" and isinstance(value, np.ndarray | list | tuple):
        with device:  # onto this tensor's GPU, not whichever one is current
            return device.xp.asarray(value)
    return value


class Tensor(TensorOps):
    """An n-dimensional array on a device, with reverse-mode autodiff.

    Build tensors with :func:`tensorlib.tensor`, :func:`tensorlib.zeros` and friends, or
    ``Tensor(data, dtype=None, device=None, requires_grad=False)`` (which copies ``data``).

    Attributes:
        requires_grad: whether operations on this tensor are recorded for backward.
    """

    # _grad_buffer is set only by set_grad_buffer (read with getattr(..., None)): leaving it
    # unset keeps tensor creation, the hot path, one store shorter.
    __slots__ = (
        "__weakref__",
        "_ctx",
        "_data",
        "_device",
        "_grad",
        "_grad_buffer",
        "_hooks",
        "requires_grad",
    )

    _data: Any
    _device: Device
    _grad: Tensor | None
    _ctx: _autograd.Function | None
    _hooks: dict[int, Callable[[Tensor], None]] | None
    requires_grad: bool

    # Make NumPy defer to our reflected operators (ndarray + Tensor -> Tensor.__radd__).
    __array_priority__ = 1000
    __array_ufunc__ = None

    def __init__(
        self,
        data: Any,
        dtype: Any = None,
        device: str | Device | None = None,
        requires_grad: bool = False,
    ) -> None:
        from ._creation import _to_array

        array, dev = _to_array(data, dtype, device, copy=True)
        self._data = array
        self._device = dev
        self._grad = None
        self._ctx = None
        self._hooks = None
        self.requires_grad = False
        if requires_grad:
            self.requires_grad_(True)

    @classmethod
    def _wrap(cls, array: Any, device: Device | None = None) -> Tensor:
        """Wrap an array without copying or checks (internal fast path)."""
        if isinstance(array, np.generic):
            array = np.asarray(array)
        t = object.__new__(cls)
        t._data = array
        t._device = device if device is not None else device_of(array)
        t._grad = None
        t._ctx = None
        t._hooks = None
        t.requires_grad = False
        return t

    # ------------------------------------------------------------------ properties
    @property
    def data(self) -> Any:
        """The underlying NumPy or CuPy array (no graph: writing to it is not recorded)."""
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        if isinstance(value, Tensor):
            dev = value._device
            value = value._data
        else:
            dev = device_of(value)
            if dev is CPU and self._device.type == "cpu":
                dev = self._device  # a NumPy array stays on this logical CPU device (cpu:1)
        _check_array_dtype(value)
        self._data = value
        self._device = dev

    @property
    def grad(self) -> Tensor | None:
        """The accumulated gradient (a Tensor of this tensor's shape), or None."""
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | Any | None) -> None:
        if value is None:
            self._grad = None
            return
        g = value if isinstance(value, Tensor) else Tensor._wrap(value)
        if tuple(g.shape) != tuple(self.shape):
            raise ValueError(
                f"assigned grad has shape {tuple(g.shape)} but the tensor has shape "
                f"{tuple(self.shape)}"
            )
        if g.dtype != self.dtype:
            raise TypeError(f"assigned grad has dtype {g.dtype} but the tensor has {self.dtype}")
        if g._device is not self._device:
            raise ValueError(f"assigned grad is on {g._device} but the tensor is on {self._device}")
        self._grad = g

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, as a tuple of ints."""
        return tuple(self._data.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return int(self._data.ndim)

    @property
    def size(self) -> int:
        """Number of elements (NumPy's name)."""
        return int(self._data.size)

    def numel(self) -> int:
        """Number of elements."""
        return int(self._data.size)

    @property
    def nbytes(self) -> int:
        """Bytes held by the data."""
        return int(self._data.nbytes)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element dtype (a NumPy dtype)."""
        return self._data.dtype

    @property
    def device(self) -> Device:
        """The device the data lives on."""
        return self._device

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded operation."""
        return self._ctx is None

    @property
    def grad_fn(self) -> _autograd.Function | None:
        """The Function that produced this tensor, or None for leaves."""
        return self._ctx

    @property
    def T(self) -> Tensor:
        """The transpose (all axes reversed)."""
        return self.transpose()

    # ------------------------------------------------------------------ conversion
    def numpy(self) -> np.ndarray[Any, Any]:
        """Return the data as a NumPy array (shares memory on the CPU; copies from a GPU)."""
        if self._device.type == "cpu":  # cpu and the logical cpu:N
            return self._data
        return self._data.get()

    def item(self) -> Scalar:
        """Return the single element as a Python scalar."""
        if self._data.size != 1:
            raise ValueError(
                f"item(): only tensors with one element can be converted, got shape {self.shape}"
            )
        return self._data.item()  # any size-1 array has item(); a reshape is a remote record

    def tolist(self) -> Any:
        """Return the data as (nested) Python lists."""
        return self.numpy().tolist()

    def detach(self) -> Tensor:
        """Return a tensor sharing this data, cut off from the graph."""
        return Tensor._wrap(self._data, self._device)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Set ``requires_grad`` in place (only floating tensors can require grad)."""
        if requires_grad and not is_floating(self._data.dtype):
            raise TypeError(
                f"only floating-point tensors can require gradients, got dtype {self.dtype}"
            )
        if not requires_grad and self._ctx is not None:
            raise RuntimeError(
                "requires_grad_(False) on a non-leaf tensor; use .detach() to leave the graph"
            )
        self.requires_grad = requires_grad
        return self

    def to(self, target: str | Device | Any = None, dtype: Any = None) -> Tensor:
        """Move to a device and/or cast to a dtype (differentiable).

        Args:
            target: a device (``"cpu"``, ``"cuda:0"``) or a dtype.
            dtype: a dtype, when ``target`` is a device.
        """
        out = self
        if target is not None:
            if is_device_spec(target):
                dev = Device(target)
                if dev is not self._device:
                    out = _ew.ToDevice.apply(out, device=dev, src=self._device)
            else:
                dtype = target
        if dtype is not None:
            dt = normalize_dtype(dtype)
            if dt != out.dtype:
                out = _ew.Cast.apply(out, dtype=dt)
        return out

    def astype(self, dtype: Any) -> Tensor:
        """Cast to ``dtype`` (differentiable between floating dtypes)."""
        return self.to(dtype=dtype)

    def float(self) -> Tensor:
        """Cast to float32."""
        return self.to(dtype=np.float32)

    def double(self) -> Tensor:
        """Cast to float64."""
        return self.to(dtype=np.float64)

    def half(self) -> Tensor:
        """Cast to float16."""
        return self.to(dtype=np.float16)

    def long(self) -> Tensor:
        """Cast to int64."""
        return self.to(dtype=np.int64)

    def cpu(self) -> Tensor:
        """Move to the CPU."""
        return self.to(CPU)

    def cuda(self, index: int = 0) -> Tensor:
        """Move to GPU ``index``."""
        return self.to(Device(f"cuda:{index}"))

    def __dlpack__(self, **kwargs: Any) -> Any:
        """Export the data through DLPack (zero-copy)."""
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """DLPack device tuple of the data."""
        return self._data.__dlpack_device__()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        arr = self.numpy()
        if dtype is not None:
            arr = arr.astype(dtype)
        return arr

    # ------------------------------------------------------------------ autodiff
    def backward(self, gradient: Tensor | Any | None = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``.

        Args:
            gradient: d(loss)/d(self); required unless this tensor has one element.
            retain_graph: keep saved intermediates so backward can run through them again.

        Raises:
            RuntimeError: for a non-scalar output without ``gradient``, a tensor that does not
                require grad, or a second backward through freed intermediates.
        """
        _backward.run_backward(self, gradient, retain_graph)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> Any:
        """Call ``hook(self)`` right after this leaf's ``.grad`` was accumulated in backward.

        Fires once per ``backward()`` call in which this leaf received a gradient, after all
        contributions were summed into ``.grad``. Returns a handle with ``remove()``.
        """
        if self._ctx is not None:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if not self.requires_grad:
            raise RuntimeError("cannot register a grad hook on a tensor that does not require grad")
        if self._hooks is None:
            self._hooks = {}
        handle = _backward.RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def set_grad_buffer(self, buffer: Tensor | None) -> None:
        """Let backward write this leaf's gradient straight into ``buffer``.

        When a backward pass starts with this leaf's ``.grad`` None, an op that can (the
        weight and bias gradients of ``functional.linear``) computes the gradient directly
        into ``buffer``, which then *becomes* ``.grad``: no copy into it afterwards. Other ops,
        or a ``.grad`` that already exists (accumulation), work as usual. DDP uses this so that
        gradients land in its communication buckets. ``None`` removes the buffer.

        Args:
            buffer: a C-contiguous tensor of this leaf's shape, dtype and device.

        Raises:
            RuntimeError: on a non-leaf, or a leaf that does not require grad.
            ValueError: when ``buffer`` does not match or is not contiguous.
        """
        if buffer is None:
            self._grad_buffer = None
            return
        if self._ctx is not None or not self.requires_grad:
            raise RuntimeError("set_grad_buffer: only leaf tensors that require grad have one")
        if not isinstance(buffer, Tensor):
            raise TypeError(f"set_grad_buffer: expected a Tensor, got {type(buffer).__name__}")
        b = buffer._data
        if (
            tuple(b.shape) != tuple(self._data.shape)
            or b.dtype != self._data.dtype
            or buffer._device != self._device
        ):
            raise ValueError(
                f"set_grad_buffer: buffer must match the tensor's shape {tuple(self.shape)}, "
                f"dtype {self._data.dtype} and device {self._device}; got {tuple(b.shape)}, "
                f"{b.dtype}, {buffer._device}"
            )
        if not b.flags.c_contiguous:
            raise ValueError("set_grad_buffer: buffer must be C-contiguous")
        self._grad_buffer = buffer

    def use_grad_buffer(self) -> Tensor:
        """Make the grad buffer (see :meth:`set_grad_buffer`) this leaf's ``.grad``, as it is.

        For code that fills the buffer itself: DDP copies into it a gradient that backward
        computed elsewhere, or zeros for a parameter that got none, and then makes it
        ``.grad``. Unlike assigning ``.grad``, nothing is checked again (``set_grad_buffer``
        checked the buffer) and nothing is copied: ``.grad`` *is* the buffer afterwards.

        Returns:
            The buffer, now ``.grad``.

        Raises:
            RuntimeError: when this tensor has no grad buffer.
        """
        buf = getattr(self, "_grad_buffer", None)
        if buf is None:
            raise RuntimeError("use_grad_buffer: this tensor has no grad buffer (set_grad_buffer)")
        self._grad = buf
        return buf

    def zero_grad_(self) -> None:
        """Set ``.grad`` to None."""
        self._grad = None

    # ------------------------------------------------------------------ in place
    def _check_inplace(self, op: str) -> None:
        if self.requires_grad and _autograd.is_grad_enabled():
            raise RuntimeError(
                f"{op}: in-place modification of a tensor that requires grad cannot be "
                "differentiated; do it under `with tensorlib.no_grad():` (as optimizers do)"
            )

    def __setitem__(self, index: Any, value: Any) -> None:
        """Assign into a region (not differentiable; refused on tensors that require grad)."""
        self._check_inplace("__setitem__")
        v = _value_on(value, self._device)
        # On the tensor's GPU, whichever is current (a scatter or fill kernel; _device_guard).
        on_device(self._device, self._data.__setitem__, _mv.normalize_index(index, self._device), v)

    def copy_(self, src: Tensor | Any) -> Tensor:
        """Copy ``src`` (broadcast to this shape, cast, moved to this device) into this tensor."""
        self._check_inplace("copy_")
        data = _value_on(src, self._device)
        try:
            on_device(self._device, self._data.__setitem__, Ellipsis, data)
        except ValueError as exc:
            raise ValueError(
                f"copy_: source of shape {tuple(getattr(data, 'shape', ()))} cannot be "
                f"broadcast to {self.shape}"
            ) from exc
        return self

    def fill_(self, value: Scalar) -> Tensor:
        """Set every element to ``value``."""
        self._check_inplace("fill_")
        on_device(self._device, self._data.fill, value)
        return self

    def zero_(self) -> Tensor:
        """Set every element to zero."""
        return self.fill_(0)

    # ------------------------------------------------------------------ not differentiable
    # Comparisons give bool tensors; they, argmax/argmin and any/all are not differentiable
    # (no Function), so they live here rather than with the operations in TensorOps.
    def _compare(self, other: Any, op: Callable[[Any, Any], Any]) -> Tensor:
        # Why: comparisons bypass Function.apply, so without this check a CPU and a GPU
        # tensor met inside NumPy/CuPy, which raised "Unsupported type numpy.ndarray".
        if isinstance(other, Tensor) and other._device is not self._device:
            raise RuntimeError(
                f"comparison: expected both tensors on the same device, got {self._device} "
                f"and {other._device}"
            )
        o = other._data if isinstance(other, Tensor) else other
        return Tensor._wrap(on_device(self._device, op, self._data, o), self._device)

    def __lt__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a < b)

    def __le__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a <= b)

    def __gt__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a > b)

    def __ge__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a >= b)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, lambda a, b: a != b)

    __hash__ = object.__hash__  # defining __eq__ would otherwise make tensors unhashable

    def __invert__(self) -> Tensor:
        return Tensor._wrap(on_device(self._device, self._data.__invert__), self._device)

    def __and__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a & b)

    def __or__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a | b)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Indices of the maxima (not differentiable)."""
        data = self._data
        out = on_device(self._device, lambda: data.argmax(axis=axis, keepdims=keepdims))
        return Tensor._wrap(out, self._device)

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Indices of the minima (not differentiable)."""
        data = self._data
        out = on_device(self._device, lambda: data.argmin(axis=axis, keepdims=keepdims))
        return Tensor._wrap(out, self._device)

    def any(self) -> Tensor:
        """True if any element is true (not differentiable)."""
        return Tensor._wrap(on_device(self._device, self._data.any), self._device)

    def all(self) -> Tensor:
        """True if all elements are true (not differentiable)."""
        return Tensor._wrap(on_device(self._device, self._data.all), self._device)

    # ------------------------------------------------------------------ Python protocols
    def __len__(self) -> int:
        if self._data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return int(self._data.shape[0])

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        if self._data.size != 1:
            raise ValueError(
                f"the truth value of a tensor with {self._data.size} elements is ambiguous; "
                "use .any() or .all()"
            )
        return bool(self._data.reshape(()).item())

    def __float__(self) -> builtins.float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = ""
        if self._device is not CPU:
            extra += f", device='{self._device}'"
        if self.dtype not in (np.float32, np.int64, np.bool_):
            extra += f", dtype={self.dtype}"
        if self._ctx is not None:
            extra += f", grad_fn=<{type(self._ctx).__name__}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"


def _clear_grads(tensors: Iterable[Tensor], set_to_none: bool) -> None:
    """Clear each tensor's ``.grad``: to None, or to zeros in place (``set_to_none=False``,
    which keeps a ``.grad`` that is a view, such as DDP's bucket views, that view).

    The one implementation of ``Module.zero_grad`` and ``Optimizer.zero_grad``.
    """
    with DeviceGuard() as guard:
        for t in tensors:
            grad = t._grad
            if grad is None:
                continue
            if set_to_none:
                t._grad = None
            else:
                guard.use(grad._device)  # zeroed on its GPU, whichever is current
                grad._data[...] = 0


from . import _ops_elementwise as _ew  # noqa: E402
from . import _ops_movement as _mv  # noqa: E402
