"""Running CuPy work on its tensors' own GPU, whatever GPU is current (PyTorch's device guard).

CuPy runs every kernel, and allocates every new array (``empty``, ``zeros_like``, a result),
on the calling thread's *current* CUDA device. Given an array on another GPU, its elementwise
and reduction kernels raise ("The device where the array resides (1) is different from the
current device (0)") or, where peer access is possible, compute on the current GPU and leave
the result there; matmul checks nothing and hands the other GPU's memory to the current
GPU's cuBLAS. So one thread holding tensors on several GPUs (Burn's single-controller style)
broke. Here, what computes on a CUDA tensor's data makes that tensor's GPU current and gives
the caller's current device back afterwards: ops run on their inputs' device.

The central places call in: ``Function.apply`` and the operators' shorter path (forward),
the backward engine, the optimizers' update loops, ``Tensor``'s own in-place and
non-differentiable methods. Each first tests the :class:`~._device.Device` it already holds
(``dev is CPU`` or ``dev.type != "cuda"``): a CPU op pays that test and never a CuPy call.

The current device is read each time with ``cupy.cuda.runtime.getDevice`` (``cudaGetDevice``,
a thread-local read in the CUDA runtime; ``cupy.cuda.Device()`` makes the same call and builds
an object around it), never cached: CuPy itself (``with Device(i)``, its copies between GPUs),
communication backends and user code change it without telling us. A switch is
``cudaSetDevice``, made only when the device differs, and undone afterwards (per thread, as
CUDA's current device is: rank threads keep theirs).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._device import _load_cupy

if TYPE_CHECKING:
    from ._device import Device

__all__ = ["DeviceGuard", "call_on", "cross_device_recorded", "on_device"]

# True once a Function that moves data between devices (``moves_device``) was recorded in a
# graph: until then every graph lies on one device, its root's (Function.apply keeps an op's
# inputs and output on one device), so backward switches device once, not per node.
cross_device_recorded = False

_NO_KWARGS: dict[str, Any] = {}


def call_on(
    device: Device, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn(*args, **kwargs)`` with CUDA ``device`` current, then the caller's device again.

    Args and kwargs come as a tuple and a dict so that ``fn``'s own keywords (``device=``)
    can never clash with this function's.
    """
    rt = _load_cupy().cuda.runtime
    previous = rt.getDevice()
    index = device.index
    if previous == index:
        return fn(*args, **kwargs)
    rt.setDevice(index)
    try:
        return fn(*args, **kwargs)
    finally:
        rt.setDevice(previous)


def on_device(device: Device, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ``device``: with its GPU current for a CUDA device, else as it is."""
    if device.type != "cuda":
        return fn(*args)
    return call_on(device, fn, args, _NO_KWARGS)


class DeviceGuard:
    """For a loop over tensors on several devices: :meth:`use` makes a tensor's GPU current
    (nothing for other devices), and leaving the ``with`` block makes the device that was
    current at the first switch current again.

    Example::

        with DeviceGuard() as guard:
            for p in params:
                guard.use(p.device)
                p.data -= lr * p.grad.data
    """

    __slots__ = ("_restore",)

    def __init__(self) -> None:
        self._restore = -1  # the caller's device, once this guard switched away from it

    def __enter__(self) -> DeviceGuard:
        return self

    def use(self, device: Device | None) -> None:
        """Make ``device``'s GPU current when it is a CUDA device (None: change nothing)."""
        if device is None or device.type != "cuda":
            return
        rt = _load_cupy().cuda.runtime
        current = rt.getDevice()
        if current != device.index:
            rt.setDevice(device.index)
            if self._restore < 0:
                self._restore = current

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._restore >= 0:
            _load_cupy().cuda.runtime.setDevice(self._restore)
            self._restore = -1
