"""The context engine of logical CPU devices: the reduction in host memory, in device order.

Every device's output is written by :func:`~collectives.backends._reduce.reduce_to_all`: the
in-order reduction of the cpu backend and the threads NumPy engine (so the bits match
theirs), each block reduced once and written to every device's output while in cache (logical
CPU devices own separate arrays), large ones on every core. The reduction runs in the thread
that submitted the last device's call and is complete when it returns. Large outputs are
recycled (:class:`_Pool`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._types import ReduceOp
from ..backends._reduce import UFUNCS, reduce_to_all
from ._config import DistributedConfig
from ._engines import Completed

__all__ = ["NumpyContextEngine"]


def _pool_only_refcount() -> int:
    """What ``sys.getrefcount`` says, in :meth:`_Pool.take`'s loop, of an array that nothing
    but the pool holds (measured: it differs between Python versions)."""
    held = [np.empty(0)]
    for a in held:
        return sys.getrefcount(a)
    raise AssertionError("unreachable")


_ONLY_POOL = _pool_only_refcount()
_POOL_MIN_BYTES = 64 * 1024  # smaller arrays come from NumPy's own cache of small blocks
_POOL_PER_KEY = 3  # arrays kept per (device, shape, dtype): a caller holds the last results
_POOL_KEYS = 64  # shapes remembered before the oldest is forgotten


class _Pool:
    """Output arrays recycled once nothing but the pool refers to them (a caching allocator,
    as PyTorch's for CUDA): a fresh large array costs a page fault per 4 KiB on first write,
    several times the reduction itself. Each device's arrays are its own."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[Any, ...], list[Any]] = {}

    def take(self, device: int, shape: tuple[int, ...], dtype: Any) -> Any:
        key = (device, shape, dtype)
        arrays = self._arrays.get(key)
        if arrays is not None:
            for a in arrays:
                if sys.getrefcount(a) == _ONLY_POOL:
                    return a
        out = np.empty(shape, dtype=dtype)
        if out.nbytes >= _POOL_MIN_BYTES:
            if arrays is None:
                if len(self._arrays) >= _POOL_KEYS:
                    del self._arrays[next(iter(self._arrays))]
                arrays = self._arrays[key] = []
            if len(arrays) < _POOL_PER_KEY:
                arrays.append(out)
        return out

    def clear(self) -> None:
        self._arrays.clear()


class NumpyContextEngine:
    """Reduces NumPy arrays of logical CPU devices (``cpu``, ``cpu:1``, ...)."""

    ops = frozenset(UFUNCS)

    def __init__(self, devices: list[Any], config: DistributedConfig) -> None:
        self.size = len(devices)
        self._pool = _Pool()

    def all_reduce(self, arrays: list[Any], op: ReduceOp, seq: int) -> Completed:
        first = arrays[0]
        shape, dtype = first.shape, first.dtype
        # One array per device: a later in-place write on one device must not show on another.
        if first.nbytes < _POOL_MIN_BYTES:
            outputs = [np.empty(shape, dtype) for _ in arrays]  # as take() would, sooner
        else:
            take = self._pool.take
            outputs = [take(i, shape, dtype) for i in range(self.size)]
        reduce_to_all(outputs, arrays, op, self.size, parallel=True)
        return Completed(outputs)

    def close(self) -> None:
        self._pool.clear()


def make_numpy_engine(devices: list[Any], config: DistributedConfig) -> NumpyContextEngine:
    """The factory registered for devices of type ``cpu``."""
    return NumpyContextEngine(devices, config)
