"""Functions that make tensors: from data, constants, ranges, random draws and DLPack."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._device import CPU, Device, _load_cupy, device_of
from ._device_kinds import kind_of_array, kind_of_device
from ._dtype import default_dtype_for, float32, is_floating, normalize_dtype
from ._random import Generator, default_generator
from ._tensor import Tensor, _check_array_dtype

__all__ = [
    "arange",
    "from_array",
    "from_dlpack",
    "from_numpy",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
]


def _is_array(x: Any) -> bool:
    # NumPy scalars count as arrays so that np.float64(1.0) keeps its dtype.
    return (
        isinstance(x, np.ndarray | np.generic)
        or type(x).__module__.startswith("cupy")
        or kind_of_array(x) is not None
    )


def _to_array(data: Any, dtype: Any, device: str | Device | None, copy: bool) -> tuple[Any, Device]:
    """Build an array for ``data`` on ``device`` with ``dtype`` (inferring both when None)."""
    if isinstance(data, Tensor):
        data = data._data
    src_dev = device_of(data) if _is_array(data) else CPU
    dev = Device(device) if device is not None else src_dev
    if dtype is not None:
        dt = normalize_dtype(dtype)
    elif _is_array(data):
        dt = data.dtype
        if dt.kind == "u" or dt not in (np.float16, np.float32, np.float64, np.int32, np.int64):
            dt = default_dtype_for(np.zeros(0, dtype=dt)) if dt.kind != "b" else np.dtype(bool)
    else:
        dt = default_dtype_for(data)
    if src_dev.type not in ("cpu", "cuda") and (dev is not src_dev or dt != data.dtype):
        data = data.get()  # off a registered kind's device (remote): through the host
        src_dev = CPU
    if dev.type == "cpu":
        if src_dev.type == "cuda":
            data = data.get()
        arr = np.array(data, dtype=dt, copy=copy) if copy else np.asarray(data, dtype=dt)
    elif dev.type != "cuda":  # a registered kind (remote)
        if src_dev is dev:  # on it already, with this dtype
            arr = data.copy() if copy else data
        else:
            if src_dev.type == "cuda":
                data = data.get()
            arr = kind_of_device(dev).from_host(np.asarray(data, dtype=dt), dev)
    else:
        cp = _load_cupy()
        with cp.cuda.Device(dev.index):
            if src_dev.type == "cuda" and src_dev is not dev:
                # order="A": CuPy cannot copy a strided array between GPUs as it is ("K").
                arr = cp.array(data, dtype=dt, copy=True, order="A")
            else:
                arr = cp.array(data, dtype=dt, copy=copy) if copy else cp.asarray(data, dtype=dt)
    _check_array_dtype(arr)
    return arr, dev


def tensor(
    data: Any,
    dtype: Any = None,
    device: str | Device | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """Make a tensor holding a copy of ``data``.

    Args:
        data: a scalar, (nested) sequence, NumPy/CuPy array or Tensor.
        dtype: defaults to float32 for Python floats, int64 for ints, bool for bools, and the
            array's dtype for arrays.
        device: ``"cpu"`` (default for Python data) or ``"cuda:N"``.
        requires_grad: record operations on it for backward (floating dtypes only).
    """
    return Tensor(data, dtype=dtype, device=device, requires_grad=requires_grad)


def from_numpy(array: np.ndarray[Any, Any]) -> Tensor:
    """Wrap a NumPy array without copying (they share memory)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(array).__name__}")
    _check_array_dtype(array)
    return Tensor._wrap(array, CPU)


def from_array(array: Any, device: str | Device | None = None) -> Tensor:
    """Wrap a NumPy or CuPy array without copying (they share memory), on its own device.

    Like ``torch.as_tensor`` on an array of the right kind: no copy, no dtype conversion, so
    writes to either show in the other. The tensor does not require grad. A NumPy scalar
    becomes a 0-d tensor.

    Args:
        array: a ``numpy.ndarray``, NumPy scalar or ``cupy.ndarray`` of a supported dtype.
        device: the device the tensor is on, when the array's own does not say it all: a
            logical CPU device (``"cpu:1"``) for a NumPy array. None: the array's device.

    Returns:
        A tensor whose ``.data`` is ``array``.

    Raises:
        TypeError: when ``array`` is not a NumPy or CuPy array, or its dtype is unsupported.
        ValueError: when ``device`` is not where ``array`` lives.
    """
    if type(device) is Device and device.type == "cpu" and type(array) is np.ndarray:
        _check_array_dtype(array)  # the per-call path: a host array onto a (logical) CPU device
        return Tensor._wrap(array, device)
    if not _is_array(array):
        raise TypeError(f"from_array expects a NumPy or CuPy array, got {type(array).__name__}")
    _check_array_dtype(array)
    own = device_of(array)
    if device is None:
        return Tensor._wrap(array, own)
    dev = Device(device)
    if dev is not own and not (dev.type == "cpu" and own is CPU):
        raise ValueError(
            f"from_array: the array lives on {own}, not on {dev}; wrap it without device= "
            f"or copy it with tensorlib.tensor(array, device={str(dev)!r})"
        )
    return Tensor._wrap(array, dev)


def from_dlpack(obj: Any) -> Tensor:
    """Wrap any DLPack producer (NumPy, CuPy, PyTorch, JAX arrays...) without copying."""
    dev_type, dev_id = obj.__dlpack_device__()
    if int(dev_type) == 1:  # kDLCPU
        arr = np.from_dlpack(obj)
        dev = CPU
    elif int(dev_type) == 2:  # kDLCUDA
        cp = _load_cupy()
        arr = cp.from_dlpack(obj)
        dev = Device(f"cuda:{dev_id}")
    else:
        raise TypeError(f"from_dlpack: unsupported DLPack device type {dev_type} (CPU=1, CUDA=2)")
    _check_array_dtype(arr)
    return Tensor._wrap(arr, dev)


def _shape(shape: Sequence[Any]) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], tuple | list):
        shape = shape[0]
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def _make(
    fill: Any, shape: tuple[int, ...], dtype: Any, device: Any, requires_grad: bool
) -> Tensor:
    dt = normalize_dtype(dtype) if dtype is not None else float32
    dev = Device(device) if device is not None else CPU
    xp = dev.xp
    with dev:
        arr = xp.full(shape, fill, dtype=dt)
    t = Tensor._wrap(arr, dev)
    if requires_grad:
        t.requires_grad_(True)
    return t


def zeros(
    *shape: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False
) -> Tensor:
    """A tensor of zeros (float32 unless ``dtype`` is given)."""
    return _make(0, _shape(shape), dtype, device, requires_grad)


def ones(*shape: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """A tensor of ones (float32 unless ``dtype`` is given)."""
    return _make(1, _shape(shape), dtype, device, requires_grad)


def full(
    shape: Sequence[int],
    fill_value: Any,
    dtype: Any = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor filled with ``fill_value``; dtype inferred from it when not given."""
    if dtype is None:
        dtype = default_dtype_for(fill_value)
    return _make(fill_value, _shape(tuple(shape)), dtype, device, requires_grad)


def zeros_like(t: Tensor, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Zeros with ``t``'s shape, dtype and device."""
    return _make(0, t.shape, dtype or t.dtype, t.device, requires_grad)


def ones_like(t: Tensor, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """Ones with ``t``'s shape, dtype and device."""
    return _make(1, t.shape, dtype or t.dtype, t.device, requires_grad)


def full_like(t: Tensor, fill_value: Any, dtype: Any = None) -> Tensor:
    """``fill_value`` with ``t``'s shape, dtype and device."""
    return _make(fill_value, t.shape, dtype or t.dtype, t.device, False)


def arange(
    start: float,
    stop: float | None = None,
    step: float = 1,
    dtype: Any = None,
    device: Any = None,
) -> Tensor:
    """Evenly spaced values in [start, stop) (int64 for integer arguments, else float32)."""
    if stop is None:
        start, stop = 0, start
    if dtype is None:
        ints = all(isinstance(v, int) for v in (start, stop, step))
        dtype = np.int64 if ints else float32
    dt = normalize_dtype(dtype)
    dev = Device(device) if device is not None else CPU
    with dev:
        arr = dev.xp.arange(start, stop, step, dtype=dt)
    return Tensor._wrap(arr, dev)


def _random(
    kind: str,
    shape: tuple[int, ...],
    dtype: Any,
    device: Any,
    requires_grad: bool,
    generator: Generator | None,
) -> Tensor:
    dt = normalize_dtype(dtype) if dtype is not None else float32
    if not is_floating(dt):
        raise TypeError(f"{kind} needs a floating dtype, got {dt}")
    gen = generator if generator is not None else default_generator
    draw = gen.rng.random if kind == "rand" else gen.rng.standard_normal
    host = draw(shape, dtype=np.float32 if dt == np.float16 else dt).astype(dt, copy=False)
    dev = Device(device) if device is not None else CPU
    arr, _ = _to_array(host, dt, dev, copy=False)
    t = Tensor._wrap(arr, dev)
    if requires_grad:
        t.requires_grad_(True)
    return t


def rand(
    *shape: Any,
    dtype: Any = None,
    device: Any = None,
    requires_grad: bool = False,
    generator: Generator | None = None,
) -> Tensor:
    """Uniform [0, 1) samples, reproducible from ``generator`` (or the default one)."""
    return _random("rand", _shape(shape), dtype, device, requires_grad, generator)


def randn(
    *shape: Any,
    dtype: Any = None,
    device: Any = None,
    requires_grad: bool = False,
    generator: Generator | None = None,
) -> Tensor:
    """Standard normal samples, reproducible from ``generator`` (or the default one)."""
    return _random("randn", _shape(shape), dtype, device, requires_grad, generator)
