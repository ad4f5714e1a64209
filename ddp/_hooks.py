"""Communication hooks: how a bucket of gradients is reduced across ranks.

A hook is ``hook(state, bucket) -> Work``. It must start (not finish) the communication of
``bucket.buffer()`` and return a :class:`collectives.Work` whose ``wait()`` returns a flat
array holding the bucket's *averaged* gradients: the bucket's own buffer (reduced in place)
or any other array of the same length, which DDP copies (casting) into the buffer. ``state``
is whatever was registered with the hook; by default the DDP's process group.

Every rank must issue the same collectives in the same order from its hook (DDP calls hooks
in bucket order on every rank), as for any collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import ProcessGroup, ReduceOp, Work

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook"]


class GradBucket:
    """One bucket of gradients, as a comm hook sees it.

    Attributes:
        index: the bucket's position in launch order (0 holds the last layers' gradients).
    """

    def __init__(self, index: int, buffer: Any, params: list[Any], is_last: bool) -> None:
        self.index = index
        self._buffer = buffer
        self._params = params
        self._is_last = is_last

    def buffer(self) -> Any:
        """The flat gradient buffer (every parameter's ``.grad`` is a view into it)."""
        return self._buffer

    def parameters(self) -> list[Any]:
        """The parameters whose gradients the buffer holds, in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket launched in a backward pass."""
        return self._is_last

    def __repr__(self) -> str:
        return f"<GradBucket {self.index}: {len(self._params)} params, {self._buffer.nbytes} bytes>"


def allreduce_hook(state: ProcessGroup, bucket: GradBucket) -> Work:
    """The default: average the bucket over the group's ranks in place."""
    work: Work = state.all_reduce(bucket.buffer(), ReduceOp.AVG, async_op=True)
    return work


def fp16_compress_hook(state: ProcessGroup, bucket: GradBucket) -> Work:
    """Halve the bytes moved: divide by the world size, cast to float16, sum, cast back.

    Dividing before the reduction keeps the float16 sum from overflowing; DDP casts the
    returned float16 array back into the bucket's dtype.
    """
    buf = bucket.buffer()
    half = buf * (1.0 / state.size)
    if half.dtype != np.float16:
        half = half.astype(np.float16)
    work: Work = state.all_reduce(half, ReduceOp.SUM, async_op=True)
    return work
