"""Flat gradient buckets: the one bucketing of the package.

DDP's reducer (``ddp/_reducer.py``), :func:`ddp.sync_gradients` (``ddp/_sync.py``) and
``ddp.axon``'s ``GradientBucket`` and ``GradientSynchronizer`` all put many tensors into one flat
buffer per bucket, so that a bucket costs one all-reduce instead of one per tensor. Two pieces:

* :func:`plan_buckets` decides which tensors share a bucket: tensors are taken in the order
  given, each kind (dtype and device) has one open bucket, and a bucket is closed when the
  next tensor would take it past its cap (a larger tensor gets a bucket of its own). The first
  bucket of each kind may have a smaller cap, so that DDP starts communicating early.
* :class:`FlatBucket` is one bucket's layout (each tensor's shape and offset in the flat
  buffer): the buffer's chunks in those shapes, and the arrays packed into one flat array.

The plan depends only on the kinds and sizes given, never on values, so every rank that passes
the same tensors gets the same buckets and issues the same all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FlatBucket", "plan_buckets"]


def plan_buckets(
    kinds: Sequence[Hashable], sizes: Sequence[int], cap: int, first_cap: int | None = None
) -> list[list[int]]:
    """Group items into buckets: the indexes of each bucket's items, in bucket creation order.

    Args:
        kinds: each item's kind (items of different kinds never share a bucket).
        sizes: each item's size, in the unit of ``cap`` (bytes or elements).
        cap: the most a bucket holds, unless one item alone is larger.
        first_cap: the cap of each kind's first bucket (None: ``cap``).

    Returns:
        One list of item indexes per bucket, the items of a bucket in the order given.

    Raises:
        ValueError: when ``kinds`` and ``sizes`` differ in length or a cap is not positive.
    """
    if len(kinds) != len(sizes):
        raise ValueError(f"plan_buckets: {len(kinds)} kinds but {len(sizes)} sizes")
    first = cap if first_cap is None else first_cap
    if cap <= 0 or first <= 0:
        raise ValueError(f"plan_buckets: caps must be positive, got cap={cap}, first_cap={first}")
    buckets: list[list[int]] = []
    open_bucket: dict[Hashable, int] = {}  # kind -> index of its open bucket
    filled: dict[Hashable, int] = {}  # kind -> size in its open bucket
    made: dict[Hashable, int] = {}  # kind -> buckets made so far
    for i, (kind, size) in enumerate(zip(kinds, sizes, strict=True)):
        at = open_bucket.get(kind)
        limit = first if made.get(kind, 0) <= 1 else cap
        # An empty bucket takes any item, so a tensor larger than the cap gets its own.
        if at is None or (filled[kind] > 0 and filled[kind] + size > limit):
            at = open_bucket[kind] = len(buckets)
            buckets.append([])
            filled[kind] = 0
            made[kind] = made.get(kind, 0) + 1
        buckets[at].append(i)
        filled[kind] += size
    return buckets


@dataclass
class FlatBucket:
    """The layout of one flat bucket: where each tensor's elements live in the buffer.

    Attributes:
        dtype: the dtype of every tensor in it.
        device: the device of every tensor in it.
        shapes: each tensor's shape, in buffer order.
        offsets: each tensor's first element in the buffer.
        numel: elements in the bucket.
        buffer: the flat buffer, where the owner keeps one (DDP's reducer, GradientBucket).
    """

    dtype: Any
    device: Any
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    buffer: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes the bucket's elements take."""
        return self.numel * np.dtype(self.dtype).itemsize

    def add(self, shape: Sequence[int]) -> int:
        """Append a tensor of ``shape``; its offset in the buffer."""
        offset = self.numel
        self.shapes.append(tuple(int(s) for s in shape))
        self.offsets.append(offset)
        self.numel += math.prod(self.shapes[-1])
        return offset

    def chunks(self, flat: Any = None) -> list[Any]:
        """Each tensor's part of ``flat`` (default: :attr:`buffer`) in its shape: views, so
        writing into them writes the buffer."""
        buf = self.buffer if flat is None else flat
        return [
            buf[off : off + math.prod(shape)].reshape(shape)
            for shape, off in zip(self.shapes, self.offsets, strict=True)
        ]

    def pack(self, arrays: Sequence[Any]) -> Any:
        """A new contiguous flat array holding ``arrays`` (one per slot, in bucket order)."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"FlatBucket.pack: {len(arrays)} arrays for {len(self.shapes)} slots")
        xp = self.device.xp
        if not arrays:
            return xp.zeros(0, self.dtype)
        return xp.ascontiguousarray(xp.concatenate([a.reshape(-1) for a in arrays]))
