"""The ``serial`` backend: world size 1, every collective is the identity."""

from __future__ import annotations

from .._backend import Backend, GroupInfo
from .._registry import register_backend

__all__ = ["SerialBackend"]


class SerialBackend(Backend):
    """One rank: reductions, broadcasts and gathers return the input; barrier does nothing.

    Lets the same training script run with and without distribution, never branching. It
    needs no engine of its own: :meth:`Backend.run` runs every request of a group of one.
    """

    name = "serial"
    accepts_device_arrays = True  # nothing moves, so CuPy arrays need no staging

    def __init__(self, info: GroupInfo) -> None:
        if info.size != 1:
            raise ValueError(
                f"the serial backend needs world size 1, got {info.size}; use backend='cpu' "
                "(one host) or 'nccl' (GPUs)"
            )
        super().__init__(info)


register_backend(
    "serial",
    SerialBackend,
    description="world size 1: every collective is the identity (chosen automatically)",
)
