"""The ``serial`` backend: world size 1, every collective is the identity."""

from __future__ import annotations

from .._backend import Backend, GroupInfo, Request
from .._registry import register_backend

__all__ = ["SerialBackend"]


class SerialBackend(Backend):
    """One rank: reductions, broadcasts and gathers return the input; barrier does nothing.

    Lets the same training script run with and without distribution, never branching.
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

    def run(self, req: Request) -> None:
        op = req.op
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            # The only block of the output is this rank's own input.
            req.out[...] = req.array.reshape(req.out.shape)
        # all_reduce/broadcast/reduce leave the array as it is (AVG over one rank is itself);
        # barrier has nobody to wait for.


register_backend(
    "serial",
    SerialBackend,
    description="world size 1: every collective is the identity (chosen automatically)",
)
