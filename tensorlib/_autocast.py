"""Autocast: the thread-local mixed-precision state, ``autocast`` and the one casting helper.

Inside ``with tl.autocast(dtype=tl.float16):`` each primitive whose ``Function`` class declares
an ``autocast`` policy has its floating tensor arguments cast before it runs (PyTorch's CUDA
autocast lists, restricted to the ops tensorlib has):

* ``"lower"``: to the autocast dtype (float16): ``Matmul`` and ``Linear``.
* ``"float32"``: to float32: ``Exp``, ``Log``, ``Pow``, ``Sum``, ``Softmax``, ``LogSoftmax``,
  ``LayerNormFn``, ``CrossEntropy``, and ``F.mse_loss`` (which casts its inputs itself).

Every other op runs in the type its inputs promote to. As in PyTorch, only float16 and float32
tensors on an autocast-enabled device type are cast (float64, integer and bool tensors never
are), casts go through the differentiable ``Cast`` (so float32 leaves receive float32
gradients), and backward is not autocast: each op's backward runs in the dtype its forward ran.

``Function.apply`` is the hot path, so it first reads the module global :data:`active` (how
many threads have autocast on) and only then looks at the class's policy and this thread's
state.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ._dtype import float16, float32, normalize_dtype

__all__ = ["autocast", "cast_args", "get_dtype", "is_enabled"]

F = TypeVar("F", bound=Callable[..., Any])

_DEVICE_TYPES = ("cpu", "cuda")
# Tensors of these dtypes are eligible for casting (torch: floating, but not float64).
_ELIGIBLE = frozenset({float16, float32})

# Threads in which autocast is enabled for some device type. Function.apply reads this first,
# so that with autocast off everywhere it costs one global read.
active = 0
_active_lock = threading.Lock()


class _State(threading.local):
    def __init__(self) -> None:
        # device type -> the autocast dtype there, or None where autocast is off.
        self.dtypes: dict[str, np.dtype[Any] | None] = dict.fromkeys(_DEVICE_TYPES)


_state = _State()


def is_enabled(device_type: str | None = None) -> bool:
    """Whether autocast is on in this thread (for ``device_type``, or for any device type)."""
    dtypes = _state.dtypes
    if device_type is None:
        return any(d is not None for d in dtypes.values())
    return dtypes.get(device_type) is not None


def get_dtype(device_type: str) -> np.dtype[Any] | None:
    """The autocast dtype for ``device_type`` in this thread (None when autocast is off)."""
    return _state.dtypes.get(device_type)


def _set(dtypes: dict[str, np.dtype[Any] | None]) -> None:
    global active
    was, now = is_enabled(), any(d is not None for d in dtypes.values())
    _state.dtypes = dtypes
    if was != now:
        with _active_lock:
            active += 1 if now else -1


def cast_args(policy: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with the eligible tensors cast as ``policy`` says (for ``Function.apply``).

    Args:
        policy: ``"lower"`` (to the autocast dtype) or ``"float32"``.
        args: the positional arguments of ``apply``; only float16/float32 tensors on a device
            type where autocast is on are cast, everything else passes through unchanged.
    """
    from ._ops_elementwise import Cast  # lazy: _autograd imports this module first
    from ._tensor import Tensor

    dtypes = _state.dtypes
    out = list(args)
    for i, a in enumerate(args):
        if not isinstance(a, Tensor):
            continue
        dtype = a._data.dtype
        if dtype not in _ELIGIBLE:
            continue
        lower = dtypes.get(a._device.type)
        if lower is None:  # autocast is off for this tensor's device type
            continue
        target = lower if policy == "lower" else float32
        if dtype != target:
            out[i] = Cast.apply(a, dtype=target)
    return tuple(out)


def _check_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        dt = normalize_dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt != float16:
        raise ValueError(
            f"autocast: dtype must be tensorlib.float16 (the only lower-precision floating "
            f"dtype tensorlib has; there is no bfloat16), got {dtype!r}"
        )
    return dt


class autocast:
    """Run ops in mixed precision: ``with tl.autocast(dtype=tl.float16): ...`` or a decorator.

    Inside, matmul and linear (``@``, ``tl.matmul``, ``F.linear``, ``nn.Linear``) compute in
    float16, while exp, log, pow, sum, softmax, log_softmax, layer_norm and cross_entropy run
    in float32, and every other op in the widest type of its inputs (PyTorch's CUDA autocast
    lists). Wrap the forward pass and the loss only; backward runs each op in the dtype its
    forward chose. Autocast state is per thread; nesting ``autocast(enabled=False)`` turns it
    off until that block ends.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` to autocast only tensors on that device type; None
            (the default) autocasts tensors on every device.
        dtype: the lower-precision dtype; only ``tensorlib.float16`` exists.
        enabled: False makes the block (or the decorated function) run without autocast.

    Raises:
        ValueError: for a device type other than ``"cpu"``/``"cuda"``, or a dtype other than
            float16.
    """

    def __init__(
        self, device_type: str | None = None, dtype: Any = float16, enabled: bool = True
    ) -> None:
        if device_type is not None and device_type not in _DEVICE_TYPES:
            raise ValueError(
                f"autocast: device_type must be 'cpu', 'cuda' or None (all devices), got "
                f"{device_type!r}"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__}")
        self.device_type = device_type
        self.fast_dtype = _check_dtype(dtype)
        self.enabled = enabled
        self._prev: list[dict[str, np.dtype[Any] | None]] = []

    def __enter__(self) -> None:
        prev = _state.dtypes
        self._prev.append(prev)
        value = self.fast_dtype if self.enabled else None
        new = dict(prev)
        for dev in (self.device_type,) if self.device_type is not None else _DEVICE_TYPES:
            new[dev] = value
        _set(new)

    def __exit__(self, *exc: object) -> None:
        _set(self._prev.pop())

    def __call__(self, fn: F) -> F:
        device_type, dtype, enabled = self.device_type, self.fast_dtype, self.enabled

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(device_type, dtype, enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
