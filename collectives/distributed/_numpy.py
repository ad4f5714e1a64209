"""The context engine of logical CPU devices: the reduction in host memory, in device order.

The first device's output is reduced into by :func:`~collectives.backends._reduce.
reduce_in_order` (the same in-order reduction as the cpu backend and the threads NumPy
engine, so the bits match theirs); every other device gets a copy of it, since logical CPU
devices own separate arrays. The reduction runs in the thread that submitted the last
device's call and is complete when it returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._types import ReduceOp
from ..backends._reduce import UFUNCS, reduce_in_order
from ._config import DistributedConfig

__all__ = ["NumpyContextEngine"]


class _Done:
    """A completion that is complete from the start (the reduction ran synchronously)."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        return None


class NumpyContextEngine:
    """Reduces NumPy arrays of logical CPU devices (``cpu``, ``cpu:1``, ...)."""

    ops = frozenset(UFUNCS)

    def __init__(self, devices: list[Any], config: DistributedConfig) -> None:
        self.size = len(devices)

    def all_reduce(self, arrays: list[Any], op: ReduceOp, seq: int) -> _Done:
        first = arrays[0]
        out = np.empty(first.shape, dtype=first.dtype)
        reduce_in_order(out, arrays, op, self.size)
        # One array per device: a later in-place write on one device must not show on another.
        return _Done([out] + [out.copy() for _ in arrays[1:]])

    def close(self) -> None:
        return None


def make_numpy_engine(devices: list[Any], config: DistributedConfig) -> NumpyContextEngine:
    """The factory registered for devices of type ``cpu``."""
    return NumpyContextEngine(devices, config)
