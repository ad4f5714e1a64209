"""The CUDA seam of the nccl backend: every CUDA call it makes, all through CuPy.

Streams, events, pinned memory, asynchronous copies and device arrays come from CuPy (the
fake CuPy in tests), imported through tensorlib so that a missing CuPy, driver or GPU is one
clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["D2H", "H2D", "Cuda", "device_count"]

H2D, D2H = 1, 2  # cudaMemcpyKind


def _cupy() -> Any:
    """CuPy, through tensorlib (one clear error when CuPy, a driver or a GPU is missing)."""
    from tensorlib import device

    return device("cuda").xp


def device_count() -> int:
    """How many GPUs this process sees."""
    return int(_cupy().cuda.runtime.getDeviceCount())


class Cuda:
    """The CUDA calls the backend makes, all through CuPy (the fake CuPy in tests): streams,
    events, pinned memory, asynchronous copies, device arrays."""

    def __init__(self, device: int) -> None:
        cp = _cupy()
        self.cp = cp
        self.device = device
        self.runtime = cp.cuda.runtime
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._events: list[Any] = []

    def device_count(self) -> int:
        return int(self.runtime.getDeviceCount())

    def use(self) -> None:
        """Make the group's GPU the calling thread's current device."""
        self.cp.cuda.Device(self.device).use()

    def on_device(self) -> Any:
        """``with cuda.on_device():`` the group's GPU is current, then the caller's again.

        Every call enters it: the caller's null stream, new arrays and events follow the
        calling thread's current device, which need not be the group's."""
        return self.cp.cuda.Device(self.device)

    def current_stream(self) -> Any:
        try:
            return self.cp.cuda.get_current_stream(self.device)
        except TypeError:  # CuPy < 12 takes no device argument
            return self.cp.cuda.get_current_stream()

    def event(self) -> Any:
        if self._events:
            return self._events.pop()
        with self.cp.cuda.Device(self.device):
            return self.cp.cuda.Event(block=False, disable_timing=True)

    def recycle(self, ev: Any) -> None:
        # Safe once complete: a stream that waits on it captured the record it waited for.
        if ev is not None and len(self._events) < 256:
            self._events.append(ev)

    def pinned(self, nbytes: int) -> tuple[Any, np.ndarray[Any, Any]]:
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return mem, np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def empty(self, shape: Any, dtype: Any) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.empty(shape, dtype=dtype)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        """``cudaMemcpyAsync`` on ``stream`` (``kind``: :data:`H2D` or :data:`D2H`)."""
        self.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
