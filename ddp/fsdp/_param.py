"""One unit's parameters as dim-0 shards, the full buffer they are gathered into, and the two
autograd functions that move data between them.

Layout (as FSDP2's per-parameter sharding, with its copy-in/copy-out around one flat
collective per unit): parameter ``i`` of shape ``(d0, *rest)`` is padded to ``N * rows_i`` rows
(``rows_i = ceil(d0 / N)``) and rank ``r`` keeps rows ``[r * rows_i, (r + 1) * rows_i)`` as its
shard, padding rows zero. A rank's shards, flattened one after another, make its flat shard of
``S`` elements; the all-gather gives ``(N, S)`` rank-major, which is copied out parameter-major
into the full buffer so that every full parameter is a contiguous view of it (and so stays the
same array through a free and a regather). The gradient goes the other way: the full buffer's
gradient is copied into rank-major ``(N, S)`` and reduce-scattered asynchronously (overlapping
the backward of the units below), its rows landing in the shards' ``.grad`` at the end of backward.

The full buffer is an anonymous memory mapping: freeing it (``madvise(MADV_DONTNEED)``) hands
its pages back to the system while every view of it, such as the arrays that backward saved,
stays valid, and regathering fills the same memory again: what PyTorch does by resizing the
unsharded parameters' storage to zero and back.
"""

from __future__ import annotations

import math
import mmap
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import tensorlib as tl
from tensorlib import Function

if TYPE_CHECKING:
    from tensorlib.nn import Module, Parameter

    from ._unit import Unit

__all__ = [
    "FullBuffer",
    "GatherParams",
    "PreBackward",
    "ShardedParam",
    "layout_of_shard",
    "shard_rows",
]

# id(shard Parameter) -> (a weak reference to it, its layout): how code that is handed only
# parameters (``ddp.clip_grad_norm_``) tells a shard from a full parameter. Tensors compare
# elementwise, so they cannot key a WeakKeyDictionary; an entry goes when its shard dies.
_SHARDS: dict[int, tuple[weakref.ref[Parameter], ShardedParam]] = {}


def shard_rows(d0: int, world: int) -> int:
    """Rows of a dimension-0 shard: ``ceil(d0 / world)`` (the last ranks' shards padded)."""
    return -(-d0 // world)


@dataclass
class ShardedParam:
    """Where one parameter of a unit lives, full and sharded.

    Attributes:
        name: its qualified name under the unit's module (for messages).
        shape: the full (unpadded) shape.
        rows: rows of each rank's shard (``ceil(shape[0] / N)``).
        shard_off: offset of this rank's shard in the flat shard (``S`` elements).
        full_off: offset of the padded full parameter in the full buffer.
        shard: the Parameter the module and the optimizer now hold (this rank's rows).
        places: every ``(module, attribute)`` that registered it (a tied weight has several).
    """

    name: str
    shape: tuple[int, ...]
    rows: int
    shard_off: int
    full_off: int
    shard: Parameter
    places: list[tuple[Module, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        key = id(self.shard)
        _SHARDS[key] = (weakref.ref(self.shard, lambda _: _SHARDS.pop(key, None)), self)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (padding included)."""
        return self.rows * math.prod(self.shape[1:])

    def full_view(self, flat: Any, world: int) -> Any:
        """The full parameter as a view of ``flat`` (an array or a Tensor): the padded rows
        reshaped, then the padding cut off."""
        n = self.shard_numel * world
        return flat[self.full_off : self.full_off + n].reshape(
            (self.rows * world, *self.shape[1:])
        )[: self.shape[0]]


def layout_of_shard(p: Any) -> ShardedParam | None:
    """The layout of ``p`` when it is a ``fully_shard`` shard, else None."""
    entry = _SHARDS.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


class FullBuffer:
    """The unit's gathered parameters: ``numel`` elements that can be freed and refilled."""

    def __init__(self, numel: int, dtype: Any) -> None:
        # Private: MADV_DONTNEED drops a private anonymous mapping's pages (a shared one
        # would keep them in shared memory).
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, max(1, numel * np.dtype(dtype).itemsize), flags=flags)
        self.array: np.ndarray[Any, Any] = np.frombuffer(self._map, dtype=dtype, count=numel)
        self.gathered = False

    def free(self) -> None:
        """Give the pages back (the memory reads as zeros until the next fill)."""
        self._map.madvise(mmap.MADV_DONTNEED)
        self.gathered = False


class GatherParams(Function):
    """Shards -> the unit's full buffer (all-gather); backward reduce-scatters the buffer's
    gradient into each shard's (the average over the group, as DDP's all-reduce)."""

    __slots__ = ("unit",)

    def forward(self, *shards: Any, unit: Unit) -> Any:
        # The shards are inputs for the graph's edges (backward returns their gradients);
        # the unit reads them itself, into one flat all-gather.
        self.unit = unit
        unit.gather()
        return unit.buffer.array

    def backward(self, grad: Any) -> tuple[Any, ...]:
        unit = self.unit
        if not unit.buffer.gathered:
            # Gradients of this unit's layers were just computed from a freed buffer (zeros).
            raise RuntimeError(
                f"fully_shard({unit.label}): backward reached the unit's parameters after they "
                f"were freed; the unit's forward output must be what backward flows through "
                f"(a Tensor or a tuple/list of Tensors returned by forward), so that its "
                f"parameters are gathered again first"
            )
        unit.reduce_scatter_grad(grad)
        # The shards' gradients arrive at the end of backward (see Unit.reduce_scatter_grad).
        return (None,) * len(unit.params)


class PreBackward(Function):
    """Identity on a unit's forward output whose backward regathers the unit's parameters
    (freed after forward under ``reshard_after_forward=True``) before the unit's own layers
    run their backward."""

    __slots__ = ("unit",)

    def forward(self, x: Any, unit: Unit) -> Any:
        self.unit = unit
        return x

    def backward(self, grad: Any) -> Any:
        unit = self.unit
        if not unit.buffer.gathered:
            unit.gather()
            nxt = unit.schedule.next_backward(unit)
            if nxt is not None and not nxt.buffer.gathered:
                nxt.prefetch()  # its all-gather runs while this unit's backward computes
                tl.queue_callback(nxt.drop_prefetch)  # in case its backward never comes
        return grad
