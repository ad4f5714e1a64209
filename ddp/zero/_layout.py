"""ZeRO-1's layout: the flat partition of the parameters and the all-gather buckets.

The parameters of each parameter group, one (dtype, device) kind at a time, are laid end to
end in a flat :class:`Space` of ``T`` elements, padded to ``N * S`` (``S = ceil(T / N)``).
Rank ``r`` owns the elements ``[r*S, (r+1)*S)``: every rank's share is even to within
``N - 1`` elements whatever the shapes (nanotron's and DeepSpeed's flat partition; torch packs
whole parameters greedily, which leaves one rank with most of the state when one layer
dominates). The part of a parameter that a rank owns is a :class:`Piece`.

The updated elements travel in :class:`GatherBucket` s: the shard offsets ``[0, S)`` are cut
where any rank's parameters begin or end, and consecutive cuts are grouped by the package's
one bucketing (``ddp/_buckets.py``). The layout depends only on shapes, dtypes and the world
size, so every rank computes the same buckets and issues the same all-gathers.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorlib import Tensor

from .._buckets import plan_buckets

__all__ = ["GatherBucket", "Piece", "Space", "flat", "make_spaces", "on_device", "plan_gather"]


@dataclass
class Piece:
    """The part of one parameter that a rank owns: elements ``[lo, hi)`` of its flat view."""

    index: int  # the parameter's index over all groups (state_dict numbering)
    param: Tensor
    lo: int
    hi: int
    offset: int  # the parameter's first element in its space
    tensor: Tensor | None = None  # this rank's piece tensor (None for other ranks' pieces)


@dataclass
class Space:
    """One flat partition: a parameter group's parameters of one dtype and device."""

    group: int
    dtype: Any
    device: Any
    params: list[Tensor]
    indexes: list[int]
    offsets: list[int]
    total: int
    shard: int

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of the parameters that ``rank`` owns, in flat order."""
        start, stop = rank * self.shard, min((rank + 1) * self.shard, self.total)
        out: list[Piece] = []
        for p, i, off in zip(self.params, self.indexes, self.offsets, strict=True):
            lo, hi = max(start, off), min(stop, off + p.size)
            if lo < hi:
                out.append(Piece(i, p, lo - off, hi - off, off))
        return out


@dataclass
class GatherBucket:
    """Shard offsets ``[a, b)`` of one space, all-gathered in one call."""

    space: Space
    a: int
    b: int
    # Per rank: (column in the row, parameter, first element in the parameter, count).
    copies: list[list[tuple[int, Tensor, int, int]]] = field(default_factory=list)


def make_spaces(k: int, params: Sequence[Tensor], base: int, n: int) -> list[Space]:
    """The flat spaces of parameter group ``k`` (one per dtype and device) over ``n`` ranks.

    Args:
        k: the group's index.
        params: the group's parameters.
        base: the index (over all groups) of the group's first parameter.
        n: the world size.

    Raises:
        ValueError: for a parameter whose array is not contiguous (a piece must view it).
    """
    kinds: dict[Any, list[int]] = {}
    for j, p in enumerate(params):
        if not p.data.flags.c_contiguous:
            raise ValueError(
                f"ZeroRedundancyOptimizer: parameter {base + j} (shape {p.shape}) is not "
                "contiguous; its shard must be a view of it (make it contiguous first)"
            )
        kinds.setdefault((str(p.dtype), p.device), []).append(j)
    spaces = []
    for members in kinds.values():
        ps = [params[j] for j in members]
        offsets = [int(o) for o in np.cumsum([0] + [p.size for p in ps[:-1]])]
        total = int(sum(p.size for p in ps))
        shard = max(1, math.ceil(total / n))
        spaces.append(
            Space(
                k, ps[0].dtype, ps[0].device, ps, [base + j for j in members], offsets, total, shard
            )
        )
    return spaces


def plan_gather(spaces: Sequence[Space], n: int, cap: int) -> list[GatherBucket]:
    """Cut each space's shard offsets where any rank's parameters begin or end, and group
    the cuts into all-gather buckets of at most ``cap`` bytes a rank (``plan_buckets``)."""
    buckets: list[GatherBucket] = []
    if n == 1:
        return buckets
    for si, space in enumerate(spaces):
        cuts = {0, space.shard}
        for r in range(n):
            start = r * space.shard
            for off in [*space.offsets, space.total]:
                if start < off < start + space.shard:
                    cuts.add(off - start)
        spans = list(itertools.pairwise(sorted(cuts)))
        itemsize = np.dtype(space.dtype).itemsize
        plan = plan_buckets([si] * len(spans), [(b - a) * itemsize for a, b in spans], cap)
        for members in plan:
            a, b = spans[members[0]][0], spans[members[-1]][1]
            bucket = GatherBucket(space, a, b)
            for r in range(n):
                row: list[tuple[int, Tensor, int, int]] = []
                for piece in space.pieces(r):
                    # The piece's flat range, in shard offsets of rank r, cut to [a, b).
                    shift = piece.offset - r * space.shard
                    lo, hi = max(a, shift + piece.lo), min(b, shift + piece.hi)
                    if lo < hi:
                        row.append((lo - a, piece.param, lo - shift, hi - lo))
                bucket.copies.append(row)
            buckets.append(bucket)
    return buckets


def on_device(device: Any) -> Any:
    """Make ``device`` current while allocating (CuPy allocates on the current GPU)."""
    return contextlib.nullcontext() if device.type == "cpu" else device


def flat(a: Any) -> Any:
    """A 1-D view of a contiguous array (never a copy: writes must reach the array).

    Raises:
        ValueError: for an array that is not C-contiguous (a parameter replaced by one).
    """
    if not a.flags.c_contiguous:
        raise ValueError(
            f"ZeroRedundancyOptimizer: an array of shape {a.shape} is not contiguous; a "
            "shard must be a view of it (make the parameter contiguous)"
        )
    return a.reshape(-1)
